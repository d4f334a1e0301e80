// The CPU kernels' raw-pointer entry points, for C++ callers that chain them without torch operators between
// (`decoder_stack.cpp`). The torch operators run the same functions, so both compute the same bits. Each is defined
// for float, c10::BFloat16 and c10::Half; rows are contiguous.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cstdint>
#include <thread>

namespace nanovllm {

// A barrier for a team's threads: the last to arrive starts the next generation, the others spin on it, then yield
// the core after SPINS tries (a thread of the team descheduled on a busy machine). OpenMP's own barrier cost ~600
// cycles on two threads (libgomp, Zen 5), and ~1,000 more where one arrived well before the other; this one ~150. A
// decode step passes 7 a layer: batch-1 decode 1.6% faster, measured in one process against `omp barrier`.
class TeamBarrier {
 public:
  void wait(int size) {
    const unsigned generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int tries = 0; generation_.load(std::memory_order_acquire) == generation; ++tries) {
      if (tries < SPINS) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int SPINS = 20000;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<unsigned> generation_{0};
};

// The threads of one OpenMP region that run a whole decode step together (`decoder_stack.cpp`), instead of one
// region per kernel: a kernel given a team does only this thread's share of its work and returns without waiting
// for the others; its caller puts `barrier()` between kernels whose data pass from one thread to another. A kernel
// given none (nullptr) splits its work over torch's threads itself. Shares never change a row's arithmetic, so both
// compute the same bits.
struct Team {
  int id = 0, size = 1;
  TeamBarrier* sync = nullptr;  // shared by the team's threads where size > 1
  void barrier() const {
    if (size > 1) sync->wait(size);
  }
};

// fn(first, last) over [0, count): a team thread's contiguous share, or pieces of at least `grain` over torch's
// threads.
template <typename F>
void split(const Team* team, int64_t count, int64_t grain, const F& fn) {
  if (team == nullptr) return at::parallel_for(0, count, grain, fn);
  const int64_t first = count * team->id / team->size, last = count * (team->id + 1) / team->size;
  if (first < last) fn(first, last);
}

// fused_ops.cpp: one row each, on the calling thread.
template <typename T>  // out = weight * x / rms(x), over n values
void rms_norm_row(const T* x, const T* weight, T* out, int64_t n, float eps);
template <typename T>  // sum = x + residual (rounded to T), out = rms_norm(sum)
void add_rms_norm_row(const T* x, const T* residual, const T* weight, T* out, T* sum, int64_t n, float eps);
template <typename T>  // rotate-half rotary embedding of one head of `2 * half` values; cos then sin, `half` each
void rotary_row(const T* in, T* out, const float* cos_sin, int64_t half);
template <typename T>  // out = silu(gate) * up, n values
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n);

// paged_decode.cpp: `rows` single queries q [rows, heads, head_dim] against their cached K/V (caches
// [blocks, block_size, kv_heads, head_dim], row i's blocks in block_tables[i * table_width...]); rows with context
// length 0 are left as they are. Threads over (row, KV head, chunk of keys), then over (row, KV head). The caches
// hold T, or 8-bit floats (c10::Float8_e4m3fn, c10::Float8_e5m2) for every T, K then in tiles (`KEY_TILE` in
// cpu_math.h), or an int8 cache's bytes (`Int8Scaled`: rows head_dim + 4 wide, K and V in tiles). A team shares
// `partials` (`paged_decode_partials` floats).
constexpr int64_t MAX_HEAD_DIM = 1024;
// Refuses an 8-bit K cache (`element_size` 1) whose blocks of `block_size` tokens cannot hold whole tiles.
void check_key_tiles(int64_t element_size, int64_t block_size);
template <typename T, typename C>
void paged_decode_rows(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                       const int32_t* context_lens, T* out, int64_t rows, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t block_size, int64_t table_width, float scale, int64_t window,
                       float softcap, const Team* team = nullptr, float* partials = nullptr);
int64_t paged_decode_partials(const int32_t* context_lens, int64_t rows, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, int64_t window);

// ggml_quant.cpp: out [M, N] (rows `ldo` apart) = x [M, K] . w [N, K] + bias, w rows `w_stride` bytes apart in GGML
// type `qtype` (as the file has them, or repacked in tiles of `lanes` rows), one `ggml_supported` says runs on path
// `isa`; this thread's share of `team`: it quantizes its share of the activations into `scratch`
// (`ggml_scratch_bytes`, shared), waits for the others, then takes its weight rows. `own_scratch`: every thread
// quantizes all of them into a `scratch` of its own and waits for no one (a few rows cost less than a barrier).
template <typename T>
void ggml_matmul(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t w_stride, int64_t N, int64_t qtype,
                 int64_t isa, int64_t lanes, const T* bias, T* out, int64_t ldo, const Team& team, void* scratch,
                 bool own_scratch = false);
int64_t ggml_scratch_bytes(int64_t M, int64_t K);
bool ggml_supported(int64_t qtype, int64_t isa, int64_t lanes, int64_t rows);

// lora_ops.cpp: y [rows, out] (rows `y_stride` apart) += each row's LoRA delta for x [rows, in], row r under adapter
// slot row_slot[r] (`slots` or more: none); the step's adapters packed as `LoRALayer` packs them (`Packed`: each
// slot's A and B transposed flat, the slice table, scales, each slot's first slice). Threads over tiles of rows.
template <typename T>
void lora_rows(const T* x, T* y, const T* const* a, const T* const* bt, const int64_t* slices, const float* scales,
               const int64_t* row_slot, const int64_t* slot_slices, int64_t rows, int64_t in, int64_t out,
               int64_t slots, int64_t y_stride, const Team* team = nullptr);

}  // namespace nanovllm
