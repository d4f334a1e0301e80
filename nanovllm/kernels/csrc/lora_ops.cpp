// LoRA deltas on the CPU, every row's own adapter in one call (vLLM's BGMV shape): for row r of adapter slot s,
// y[r] += sum over s's slices of scale * B_slice (A_slice x[r]). Each row computes only its own adapter's products,
// in an order fixed by its adapter alone, so its result depends neither on its batch nor on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "cpu_ops.h"

// A row goes through `lora_tile<1>` alone and `lora_tile<TILE>` beside rows of its adapter: its bits agree only if
// both round every multiply-add alike. Fusing some into FMAs in one instantiation and not in the other is the one
// value-changing freedom the compiler has here (with GCC 13.3 on a Sapphire Rapids Xeon a row's delta changed with its
// batch), so nothing is fused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

// The slice table's columns: the adapter slot, its first row in the stacked A, its rank, its output columns
// (offset, size), and where its B^T (rank x size, row-major) starts in the flat `bt` buffer.
enum Column { SLOT, A_ROW, RANK, OUT_OFFSET, OUT_SIZE, BT_OFFSET, COLUMNS };

constexpr int64_t TILE = 4;  // rows of one adapter computed together, each A and B^T row read once for all of them

// 16 floats as the CPU's own vectors: one AVX-512 register, two AVX2 ones or four SSE ones (GCC's 16-float vectors on
// AVX2 went through memory: a float times one was 16 stores and a reload). The same lanes on every path, so the same
// sums.
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#elif defined(__AVX2__)
constexpr int64_t LANES = 8;
#else
constexpr int64_t LANES = 4;
#endif
constexpr int64_t PARTS = 16 / LANES;
typedef float Lanes __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t Halves __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t Words __attribute__((vector_size(LANES * 4)));
struct Floats16 {
  Lanes part[PARTS] = {};

  void store(float* out) const {
    for (int64_t p = 0; p < PARTS; ++p) *reinterpret_cast<Lanes*>(out + LANES * p) = part[p];
  }
  Floats16& add_product(const Floats16& a, const Floats16& b) {  // += a * b, lane by lane
    for (int64_t p = 0; p < PARTS; ++p) part[p] += a.part[p] * b.part[p];
    return *this;
  }
  Floats16& add_product(float c, const Floats16& b) {
    for (int64_t p = 0; p < PARTS; ++p) part[p] += c * b.part[p];
    return *this;
  }
};

static inline Floats16 load16(const float* p) {
  Floats16 v;
  for (int64_t k = 0; k < PARTS; ++k) v.part[k] = *reinterpret_cast<const Lanes*>(p + LANES * k);
  return v;
}
static inline Floats16 load16(const c10::BFloat16* p) {  // bfloat16 is the high half of a float
  Floats16 v;
  for (int64_t k = 0; k < PARTS; ++k) {
    Halves half;
    std::memcpy(&half, p + LANES * k, sizeof half);
    const Words bits = __builtin_convertvector(half, Words) << 16;
    std::memcpy(&v.part[k], &bits, sizeof bits);
  }
  return v;
}
static inline Floats16 load16(const c10::Half* p) {
  alignas(64) float x[16];
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(p[i]);
  return load16(x);
}
static inline float sum16(const Floats16& v) {
  alignas(64) float x[16];
  v.store(x);
  float s = 0.f;
  for (int64_t i = 0; i < 16; ++i) s += x[i];
  return s;
}

// shrunk[t * rank + k] = scale * A_k . x_t for the tile's NT rows (xf, float32, `in` apart) and the slice's rank
// rows of A: each A row read once for all NT rows, 16 values at a time, then a scalar tail.
template <int64_t NT, typename T>
void shrink(const T* a, int64_t rank, int64_t in, const float* xf, float scale, float* shrunk) {
  const int64_t body = in / 16 * 16;
  for (int64_t k = 0; k < rank; ++k) {
    const T* ak = a + k * in;
    Floats16 acc[NT];
    for (int64_t i = 0; i < body; i += 16) {
      const Floats16 w = load16(ak + i);
      for (int64_t t = 0; t < NT; ++t) acc[t].add_product(w, load16(xf + t * in + i));
    }
    for (int64_t t = 0; t < NT; ++t) {
      float dot = sum16(acc[t]);
      for (int64_t i = body; i < in; ++i) dot += to_float(ak[i]) * xf[t * in + i];
      shrunk[t * rank + k] = dot * scale;
    }
  }
}

// y_t[j] += sum_k shrunk[t * rank + k] * bt[k * size + j] for the tile's n of NT rows, WIDTH outputs at a time (each
// B^T value read once for all NT rows; 32 on AVX-512, 16 where 16 registers hold the sums), then a scalar tail: each
// output's products added in the order of k from 0 either way.
template <int64_t NT, typename T>
void expand(const T* bt, int64_t rank, int64_t size, const float* shrunk, T* const* y, int64_t n) {
  constexpr int64_t WIDTH = LANES == 16 ? 32 : 16;
  const int64_t body = size / WIDTH * WIDTH;
  for (int64_t j = 0; j < body; j += WIDTH) {
    Floats16 acc[NT][WIDTH / 16];
    for (int64_t k = 0; k < rank; ++k) {
      Floats16 b[WIDTH / 16];
      for (int64_t h = 0; h < WIDTH / 16; ++h) b[h] = load16(bt + k * size + j + 16 * h);
      for (int64_t t = 0; t < NT; ++t) {
        const float c = shrunk[t * rank + k];
        for (int64_t h = 0; h < WIDTH / 16; ++h) acc[t][h].add_product(c, b[h]);
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      alignas(64) float sums[WIDTH];
      for (int64_t h = 0; h < WIDTH / 16; ++h) acc[t][h].store(sums + 16 * h);
      for (int64_t l = 0; l < WIDTH; ++l) y[t][j + l] = from_float<T>(to_float(y[t][j + l]) + sums[l]);
    }
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = body; j < size; ++j) {
      float d = 0.f;
      for (int64_t k = 0; k < rank; ++k) d += shrunk[t * rank + k] * to_float(bt[k * size + j]);
      y[t][j] = from_float<T>(to_float(y[t][j]) + d);
    }
}

// y's rows `rows[0..n)` (n <= NT, one adapter, whose slices are first..last) += their deltas. A short tile computes
// the missing rows' products on zeros and drops them. Each row has its own accumulators, so it goes through the same
// operations whatever its tile (NT = 1 for a row alone, TILE otherwise).
template <int64_t NT, typename T>
void lora_tile(const T* x, T* y, const T* a, const T* bt, const int64_t* slices, const float* scales, int64_t first,
               int64_t last, const int64_t* rows, int64_t n, int64_t in, int64_t y_stride, float* xf, float* shrunk) {
  for (int64_t t = 0; t < NT; ++t)
    for (int64_t i = 0; i < in; ++i) xf[t * in + i] = t < n ? to_float(x[rows[t] * in + i]) : 0.f;
  for (int64_t s = first; s < last; ++s) {
    const int64_t* info = slices + s * COLUMNS;
    const int64_t rank = info[RANK];
    shrink<NT>(a + info[A_ROW] * in, rank, in, xf, scales[s], shrunk);
    T* outputs[NT];
    for (int64_t t = 0; t < n; ++t) outputs[t] = y + rows[t] * y_stride + info[OUT_OFFSET];
    expand<NT>(bt + info[BT_OFFSET], rank, info[OUT_SIZE], shrunk, outputs, n);
  }
}

}  // namespace

namespace nanovllm {

template <typename T>
void lora_rows(const T* x, T* y, const T* const* a, const T* const* bt, const int64_t* slices, const float* scales,
               const int64_t* row_slot, const int64_t* slot_slices, int64_t rows, int64_t in, int64_t out,
               int64_t slots, int64_t y_stride, const Team* team) {
  int64_t max_rank = 0;
  for (int64_t s = 0; s < slot_slices[slots]; ++s) max_rank = std::max(max_rank, slices[s * COLUMNS + RANK]);
  std::vector<int64_t> order;  // the adapted rows by adapter, then tiles of up to TILE of them
  for (int64_t r = 0; r < rows; ++r)
    if (row_slot[r] >= 0 && row_slot[r] < slots) order.push_back(r);
  std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return row_slot[p] < row_slot[q]; });
  std::vector<int64_t> tiles;  // (first index in order, row count)
  for (size_t i = 0; i < order.size();) {
    size_t e = i + 1;
    while (e < order.size() && static_cast<int64_t>(e - i) < TILE && row_slot[order[e]] == row_slot[order[i]]) ++e;
    tiles.push_back(static_cast<int64_t>(i)), tiles.push_back(static_cast<int64_t>(e - i));
    i = e;
  }
  const int64_t count = static_cast<int64_t>(tiles.size()) / 2;
  split(team, count, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(TILE * in), shrunk(TILE * max_rank);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* tile_rows = order.data() + tiles[2 * i];
      const int64_t slot = row_slot[tile_rows[0]];
      const int64_t n = tiles[2 * i + 1];
      (n == 1 ? lora_tile<1, T> : lora_tile<TILE, T>)(x, y, a[slot], bt[slot], slices, scales, slot_slices[slot],
                                                      slot_slices[slot + 1], tile_rows, n, in, y_stride, xf.data(),
                                                      shrunk.data());
    }
  });
}

#define NANOVLLM_LORA_ROWS(T)                                                                             \
  template void lora_rows<T>(const T*, T*, const T* const*, const T* const*, const int64_t*, const float*, \
                             const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,    \
                             const Team*);
NANOVLLM_LORA_ROWS(float)
NANOVLLM_LORA_ROWS(c10::BFloat16)
NANOVLLM_LORA_ROWS(c10::Half)

}  // namespace nanovllm

// y [rows, out] (rows contiguous, any row stride) += each row's adapter delta for input x [rows, in]: slot i's A
// `a[i]` [its ranks' sum, in] and its slices' B transposed `bt[i]`, flat (empty where it has no slice); `slices`
// [n, COLUMNS] int64 sorted by slot (A rows and B offsets within the slot's own tensors), `scales` [n] float32,
// `row_slot` [rows] int64 (the row's adapter slot; `slots` or more: the base, no delta), `slot_slices` [slots + 1]
// int64: slot s's slices are slices[slot_slices[s] .. slot_slices[s + 1]).
void lora_add(at::Tensor y, at::Tensor x, std::vector<at::Tensor> a, std::vector<at::Tensor> bt, at::Tensor slices,
              at::Tensor scales, at::Tensor row_slot, at::Tensor slot_slices) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0),
              "lora_add: x [rows, in] contiguous, y [rows, out] with contiguous rows");
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.numel() == x.size(0) && slices.scalar_type() == at::kLong
                  && slot_slices.scalar_type() == at::kLong && scales.scalar_type() == at::kFloat,
              "lora_add: int64 row slots (one per row), slices and slot_slices; float32 scales");
  const int64_t slots = slot_slices.numel() - 1;
  TORCH_CHECK(static_cast<int64_t>(a.size()) == slots && static_cast<int64_t>(bt.size()) == slots,
              "lora_add: one A and one B buffer per slot");
  for (int64_t i = 0; i < slots; ++i)
    TORCH_CHECK(a[i].is_contiguous() && bt[i].is_contiguous() && a[i].scalar_type() == x.scalar_type() &&
                    bt[i].scalar_type() == x.scalar_type(), "lora_add: contiguous A and B in x's dtype");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "lora_add: x and y of one dtype");
  auto run = [&](auto zero) {
    using T = decltype(zero);
    std::vector<const T*> a_ptrs(slots), bt_ptrs(slots);
    for (int64_t i = 0; i < slots; ++i) a_ptrs[i] = a[i].const_data_ptr<T>(), bt_ptrs[i] = bt[i].const_data_ptr<T>();
    nanovllm::lora_rows<T>(x.const_data_ptr<T>(), y.data_ptr<T>(), a_ptrs.data(), bt_ptrs.data(),
                           slices.const_data_ptr<int64_t>(), scales.const_data_ptr<float>(),
                           row_slot.const_data_ptr<int64_t>(), slot_slices.const_data_ptr<int64_t>(), x.size(0),
                           x.size(1), y.size(1), slots, y.stride(0));
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "lora_add: float32, bfloat16 or float16 rows");
  }
}
