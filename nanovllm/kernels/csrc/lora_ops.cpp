// LoRA deltas on the CPU, every row's own adapter in one call (vLLM's BGMV shape): for row r of adapter slot s,
// y[r] += sum over s's slices of scale * B_slice (A_slice x[r]). Each row computes only its own adapter's products,
// in an order fixed by its adapter alone, so its result depends neither on its batch nor on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "cpu_math.h"
#include "cpu_ops.h"

namespace {

// The slice table's columns: the adapter slot, its first row in the stacked A, its rank, its output columns
// (offset, size), and where its B^T (rank x size, row-major) starts in the flat `bt` buffer.
enum Column { SLOT, A_ROW, RANK, OUT_OFFSET, OUT_SIZE, BT_OFFSET, COLUMNS };

constexpr int64_t TILE = 4;  // rows of one adapter computed together, each A and B^T row read once for all of them

// y's rows `rows[0..n)` (n <= TILE, one adapter, whose slices are first..last) += their deltas. A short tile computes
// the missing rows' products on zeros and drops them: every row goes through the same operations, whatever its tile.
template <typename T>
void lora_tile(const T* x, T* y, const T* a, const T* bt, const int64_t* slices, const float* scales, int64_t first,
               int64_t last, const int64_t* rows, int64_t n, int64_t in, int64_t y_stride, float* xf, float* shrunk,
               float* delta) {
  for (int64_t t = 0; t < TILE; ++t)
    for (int64_t i = 0; i < in; ++i) xf[t * in + i] = t < n ? to_float(x[rows[t] * in + i]) : 0.f;
  for (int64_t s = first; s < last; ++s) {
    const int64_t* info = slices + s * COLUMNS;
    const int64_t rank = info[RANK], offset = info[OUT_OFFSET], size = info[OUT_SIZE];
    for (int64_t k = 0; k < rank; ++k) {
      const T* ak = a + (info[A_ROW] + k) * in;
      float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
      for (int64_t i = 0; i < in; ++i) {
        const float w = to_float(ak[i]);
        d0 += w * xf[i];
        d1 += w * xf[in + i];
        d2 += w * xf[2 * in + i];
        d3 += w * xf[3 * in + i];
      }
      shrunk[k] = d0 * scales[s], shrunk[rank + k] = d1 * scales[s];
      shrunk[2 * rank + k] = d2 * scales[s], shrunk[3 * rank + k] = d3 * scales[s];
    }
    for (int64_t j = 0; j < n * size; ++j) delta[j] = 0.f;
    const T* b = bt + info[BT_OFFSET];
    for (int64_t k = 0; k < rank; ++k) {
      const T* bk = b + k * size;
      for (int64_t t = 0; t < n; ++t) {
        const float c = shrunk[t * rank + k];
        float* d = delta + t * size;
#pragma omp simd
        for (int64_t j = 0; j < size; ++j) d[j] += c * to_float(bk[j]);
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      T* yo = y + rows[t] * y_stride + offset;
      const float* d = delta + t * size;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) yo[j] = from_float<T>(to_float(yo[j]) + d[j]);
    }
  }
}

}  // namespace

namespace nanovllm {

template <typename T>
void lora_rows(const T* x, T* y, const T* a, const T* bt, const int64_t* slices, const float* scales,
               const int64_t* row_slot, const int64_t* slot_slices, int64_t rows, int64_t in, int64_t out,
               int64_t slots, int64_t y_stride) {
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
  at::parallel_for(0, count, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(TILE * in), shrunk(TILE * max_rank), delta(TILE * out);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* tile_rows = order.data() + tiles[2 * i];
      const int64_t slot = row_slot[tile_rows[0]];
      lora_tile(x, y, a, bt, slices, scales, slot_slices[slot], slot_slices[slot + 1], tile_rows, tiles[2 * i + 1],
                in, y_stride, xf.data(), shrunk.data(), delta.data());
    }
  });
}

template void lora_rows<float>(const float*, float*, const float*, const float*, const int64_t*, const float*,
                               const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void lora_rows<c10::BFloat16>(const c10::BFloat16*, c10::BFloat16*, const c10::BFloat16*,
                                       const c10::BFloat16*, const int64_t*, const float*, const int64_t*,
                                       const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void lora_rows<c10::Half>(const c10::Half*, c10::Half*, const c10::Half*, const c10::Half*, const int64_t*,
                                   const float*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                   int64_t);

}  // namespace nanovllm

// y [rows, out] (rows contiguous, any row stride) += each row's adapter delta for input x [rows, in]; `a` the step's
// adapters' A stacked [sum of ranks, in], `bt` every slice's B transposed, flat; `slices` [n, COLUMNS] int64 sorted
// by slot, `scales` [n] float32, `row_slot` [rows] int64 (the row's adapter slot; `slots` or more: the base, no
// delta), `slot_slices` [slots + 1] int64: slot s's slices are slices[slot_slices[s] .. slot_slices[s + 1]).
void lora_add(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor bt, at::Tensor slices, at::Tensor scales,
              at::Tensor row_slot, at::Tensor slot_slices) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0),
              "lora_add: x [rows, in] contiguous, y [rows, out] with contiguous rows");
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.numel() == x.size(0) && slices.scalar_type() == at::kLong
                  && slot_slices.scalar_type() == at::kLong && scales.scalar_type() == at::kFloat,
              "lora_add: int64 row slots (one per row), slices and slot_slices; float32 scales");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "lora_add: x, y, a and bt of one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_add", [&] {
    nanovllm::lora_rows<scalar_t>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(),
                                  bt.data_ptr<scalar_t>(), slices.data_ptr<int64_t>(), scales.data_ptr<float>(),
                                  row_slot.data_ptr<int64_t>(), slot_slices.data_ptr<int64_t>(), x.size(0), x.size(1),
                                  y.size(1), slot_slices.numel() - 1, y.stride(0));
  });
}
