// Error messages for TORCH_CHECK, built without iostreams: `TORCH_CHECK(cond, message("id ", id, " is outside"))`.
// TORCH_CHECK's own formatting of several arguments runs an std::ostringstream inside this library; on a machine whose
// compiler linked part of libstdc++ into the library (seen on an H100 machine: Ubuntu 24.04, g++ 13.3, torch
// 2.11+cu130), that copy's locale was never set up and formatting a number segfaulted instead of raising.
#pragma once
#include <string>
#include <type_traits>

namespace nanovllm {

inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

}  // namespace nanovllm
