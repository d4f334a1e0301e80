// Scalar helpers shared by the CPU kernels, written so the compiler vectorizes loops that call them.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

static inline float to_float(float x) { return x; }
static inline float to_float(c10::Half x) { return static_cast<float>(x); }
static inline float to_float(c10::BFloat16 x) {  // a shift the compiler vectorizes (c10's conversion it does not)
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x stored as T, rounded to nearest even as torch rounds an op's float result; for bfloat16 in integer arithmetic the
// compiler vectorizes (c10's conversion branches on NaN, which it does not).
template <typename T>
static inline T from_float(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

template <typename T>
static inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// exp(x) as 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2]: a polynomial the compiler vectorizes (std::exp it calls
// once per element), relative error ~2e-7; x clamped to [-87, 88] (exp(-87) = 1.6e-38, exp(88) = 1.7e38).
static inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187e-06f, x));
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
