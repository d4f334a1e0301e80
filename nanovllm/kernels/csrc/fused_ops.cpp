// The decoder's small ops on the CPU, each one pass over its rows instead of several torch operators: RMSNorm (with
// the residual add), rotary embedding, SiLU-and-mul, and the KV-cache store. Each computes what the eager torch
// code in layers/ computes, rounding to the tensor's dtype where that code does. Decode-sized inputs run on the
// calling thread (no parallel region); larger ones split their rows over torch's threads.
#pragma GCC optimize("fp-contract=off")  // a * b - c * d rounded as torch rounds it, not fused into an FMA
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <vector>

#include "cpu_math.h"
#include "cpu_ops.h"

// The row kernels, out of line (`cpu_ops.h`): the operators here and `decoder_stack.cpp` run the same machine code.
namespace nanovllm {

template <typename T>
__attribute__((noinline)) void rms_norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += to_float(x[i]) * to_float(x[i]);
  const float inverse = 1.f / std::sqrt(squares / n + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(x[i]) * inverse));
}

template <typename T>
__attribute__((noinline)) void add_rms_norm_row(const T* x, const T* residual, const T* weight, T* out, T* sum,
                                                int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) sum[i] = from_float<T>(to_float(x[i]) + to_float(residual[i]));
  rms_norm_row(sum, weight, out, n, eps);
}

// cos and sin are rounded to the dtype first and every product and sum is rounded, as the eager code computes them.
template <typename T>
__attribute__((noinline)) void rotary_row(const T* in, T* out, const float* cos_sin, int64_t half) {
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float c = round_to<T>(cos[i]), s = round_to<T>(sin[i]);
    const float x1 = to_float(in[i]), x2 = to_float(in[i + half]);
    out[i] = from_float<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
    out[i + half] = from_float<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
}

template <typename T>
__attribute__((noinline)) void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_float(gate[i]);
    out[i] = from_float<T>(round_to<T>(g / (1.f + exp_clamped(-g))) * to_float(up[i]));
  }
}

#define NANOVLLM_ROWS(T)                                                                                   \
  template void rms_norm_row<T>(const T*, const T*, T*, int64_t, float);                                   \
  template void add_rms_norm_row<T>(const T*, const T*, const T*, T*, T*, int64_t, float);                 \
  template void rotary_row<T>(const T*, T*, const float*, int64_t);                                        \
  template void silu_mul_row<T>(const T*, const T*, T*, int64_t);
NANOVLLM_ROWS(float)
NANOVLLM_ROWS(c10::BFloat16)
NANOVLLM_ROWS(c10::Half)
#undef NANOVLLM_ROWS

}  // namespace nanovllm

using nanovllm::add_rms_norm_row;
using nanovllm::rms_norm_row;
using nanovllm::rotary_row;
using nanovllm::silu_mul_row;

namespace {

constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;  // below this a parallel region costs more than it saves

int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, PARALLEL_ELEMENTS / std::max<int64_t>(row_elements, 1));
}

// Element offset of each row (every index but the last) of a tensor whose last dimension is contiguous.
class Rows {
 public:
  explicit Rows(const at::Tensor& x) : sizes_(x.sizes().vec()), strides_(x.strides().vec()) {
    TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "the last dimension must be contiguous");
    sizes_.pop_back();
    strides_.pop_back();
  }
  int64_t offset(int64_t row) const {
    int64_t at = 0;
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      at += (row % sizes_[d]) * strides_[d];
      row /= sizes_[d];
    }
    return at;
  }

 private:
  std::vector<int64_t> sizes_, strides_;
};

}  // namespace

// weight * x / rms(x) over the last dimension (float32 inside), into a new contiguous tensor.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  auto out = x.new_empty(x.sizes());
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  const Rows index(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(src + index.offset(r), w, dst + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// (rms_norm(x + residual), x + residual), the sum rounded to the dtype first, as torch's add does.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  x = x.contiguous();
  residual = residual.contiguous();
  auto out = x.new_empty(x.sizes()), sum = x.new_empty(x.sizes());
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *a = x.data_ptr<scalar_t>(), *b = residual.data_ptr<scalar_t>(), *w = weight.data_ptr<scalar_t>();
    scalar_t *dst = out.data_ptr<scalar_t>(), *total = sum.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        add_rms_norm_row(a + r * n, b + r * n, w, dst + r * n, total + r * n, n, static_cast<float>(eps));
    });
  });
  return {out, sum};
}

namespace {

// Rotate-half rotary embedding of one `[tokens, heads, head_dim]` tensor into a new contiguous one.
template <typename T>
at::Tensor rotate(const at::Tensor& x, const int64_t* positions, const float* cos_sin) {
  auto out = x.new_empty(x.sizes());
  const int64_t heads = x.size(1), dim = x.size(2), half = dim / 2, rows = x.size(0) * heads;
  const Rows index(x);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rotary_row(src + index.offset(r), dst + r * dim, cos_sin + positions[r / heads] * dim, half);
  });
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> apply_rotary(at::Tensor positions, at::Tensor q, at::Tensor k,
                                                at::Tensor cos_sin_cache) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && cos_sin_cache.scalar_type() == at::kFloat, "bad rotary inputs");
  positions = positions.to(at::kLong).contiguous();
  cos_sin_cache = cos_sin_cache.contiguous();
  at::Tensor q_out, k_out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "apply_rotary", [&] {
    q_out = rotate<scalar_t>(q, positions.data_ptr<int64_t>(), cos_sin_cache.data_ptr<float>());
    k_out = rotate<scalar_t>(k, positions.data_ptr<int64_t>(), cos_sin_cache.data_ptr<float>());
  });
  return {q_out, k_out};
}

// silu(gate) * up for x laid out as [gate | up] along the last dimension; silu rounded to the dtype first.
at::Tensor silu_and_mul(at::Tensor x) {
  x = x.contiguous();
  const int64_t width = x.size(-1), n = width / 2, rows = x.numel() / std::max<int64_t>(width, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = x.new_empty(sizes);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(src + r * width, src + r * width + n, dst + r * n, n);
    });
  });
  return out;
}

// Each token's K and V `[tokens, kv_heads, head_dim]` into its cache slot (`slot_mapping`, -1: not stored) of
// caches `[blocks, block_size, kv_heads, head_dim]` that hold the keys' dtype, 8-bit floats (rounded as torch
// rounds, saturated: `store_row`), or an int8 cache's bytes (rows head_dim + 4 wide: `store_int8`); an 8-bit K in
// tiles (`store_key`).
void store_kvcache(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping) {
  const auto cache = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == cache &&
                  v.scalar_type() == k.scalar_type() &&
                  cache_serves(cache, k.scalar_type()) && k_cache.size(3) == cache_row_width(cache, k.size(2)),
              "the caches must be contiguous and hold the keys' dtype, 8-bit floats or an int8 cache's bytes");
  const int64_t kv_heads = k_cache.size(2), head_dim = k.size(2), width = kv_heads * head_dim;
  const int64_t tokens = k.size(0);
  nanovllm::check_key_tiles(k_cache.element_size(), k_cache.size(1));
  auto rows = [&](at::Tensor x) {  // one token's heads adjacent, as in the cache
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  k = rows(k);
  v = rows(v);
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kvcache", [&] {
    with_cache_type<scalar_t>(cache, [&](auto zero) {
      using C = decltype(zero);
      const scalar_t* k_src = k.const_data_ptr<scalar_t>();
      const scalar_t* v_src = v.const_data_ptr<scalar_t>();
      C* k_dst = static_cast<C*>(k_cache.data_ptr());
      C* v_dst = static_cast<C*>(v_cache.data_ptr());
      at::parallel_for(0, tokens, grain(width), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          if (slots[t] < 0) continue;
          for (int64_t g = 0; g < kv_heads; ++g) {
            store_key(k_src + t * k.stride(0) + g * head_dim, k_dst, slots[t], g, kv_heads, head_dim);
            store_value(v_src + t * v.stride(0) + g * head_dim, v_dst, slots[t], g, kv_heads, head_dim);
          }
        }
      });
    });
  });
}
