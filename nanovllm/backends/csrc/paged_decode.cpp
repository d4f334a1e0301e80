// Paged decode attention on the CPU: every single-query row of a step in one call, reading K/V in place
// through the block tables. One work item per (row, KV head): the group's query heads against every cached key of
// the row, scores in float32, a max-subtracted softmax, then the weighted sum of V. A row's result depends only on
// its own query, its own cached K/V and this binary's fixed summation order: not on its batch, nor on threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_rows(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                        const int32_t* context_lens, T* out, int64_t rows, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * head_dim;   // next token in a block
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), scores, acc(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, g = item % kv_heads;
      const int64_t length = context_lens[row];
      if (length <= 0) continue;
      const int32_t* table = block_tables + row * table_width;
      for (int64_t h = 0; h < group; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          query[h * head_dim + d] = static_cast<float>(q[(row * heads + g * group + h) * head_dim + d]) * scale;
      scores.assign(group * length, 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const T* k = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + g * head_dim;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = query.data() + h * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * static_cast<float>(k[d]);
          scores[h * length + t] = dot;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * length;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < length; ++t) top = std::max(top, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t < length; ++t) {
          s[t] = std::exp(s[t] - top);
          total += s[t];
        }
        float* a = acc.data() + h * head_dim;
        for (int64_t t = 0; t < length; ++t) {
          const T* v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + g * head_dim;
          const float p = s[t];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(v[d]);
        }
        T* o = out + (row * heads + g * group + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(a[d] / total);
      }
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches must share a dtype");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt32).contiguous();
  context_lens = context_lens.to(torch::kInt32).contiguous();
  auto out = torch::zeros_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                          out.data_ptr<scalar_t>(), q.size(0), q.size(1), k_cache.size(2), q.size(2),
                          k_cache.size(1), block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention for single-query rows (CPU)");
}
