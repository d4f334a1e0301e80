// Bidirectional attention on the CPU over a step's ragged batch, in one call: every row of each sequence (rows
// cu_seqlens[s] to cu_seqlens[s + 1]) attends to all of its sequence's rows, or with window > 0 to those at most
// `window` positions away (|i - j| <= window), as `nanovllm.models.bert.bidirectional_attention` documents. One work
// item per (sequence, head, block of QUERY_BLOCK queries): the block's keys and values converted to float once (keys
// transposed, LANES to a tile, head_dim padded to a multiple of LANES with zeros), scores as a small matrix product
// (each key tile loaded once per SCORE_ROWS queries, each query's value broadcast against it), a float32 softmax over
// each query's keys, then P.V with each value row loaded once per PV_ROWS queries. Blocks start at their sequence's
// first row, so a row's result depends only on its sequence, not on its batch nor on the threads. Vectors are GCC's
// vector types, a register wide: 16 floats with AVX-512, 8 with AVX2.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "check.h"
#include "cpu_math.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;         // floats per vector register
constexpr int64_t ACCUMULATORS = 16;  // vectors a micro-kernel keeps in registers: of 32, or of 16 on AVX2
#else
constexpr int64_t LANES = 8;
constexpr int64_t ACCUMULATORS = 8;
#endif
typedef float floatv __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t intv __attribute__((vector_size(LANES * 4)));
#if defined(__AVX512F__)
constexpr intv LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
constexpr intv LANE = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
constexpr int64_t SCORE_ROWS = 8;
constexpr int64_t QUERY_BLOCK = 128;
constexpr int64_t MAX_HEAD_DIM = 256;

// Lane l: whether position j + l lies in [from, to).
static inline intv lanes_within(int64_t j, int64_t from, int64_t to) {
  const intv at = static_cast<int32_t>(j) + LANE;
  return (at >= static_cast<int32_t>(from)) & (at < static_cast<int32_t>(to));
}

// Lane reductions in a fixed order: halves combined, then their halves, ...
template <typename F>
static inline float reduce_lanes(const floatv x, F combine) {
  float v[LANES];
  for (int64_t i = 0; i < LANES; ++i) v[i] = x[i];
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t i = 0; i < width; ++i) v[i] = combine(v[i], v[i + width]);
  return v[0];
}

// A head's slice of the row PREFETCH_ROWS ahead asked for while this one is converted: rows lie heads * head_dim
// apart, a stride the hardware's prefetchers miss (float32 attention took a fifth longer without).
constexpr int64_t PREFETCH_ROWS = 8;

struct Layout {  // element strides of q, k, v (their last dimension is contiguous) and the heads
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, heads, group, head_dim;
};

struct Buffers {
  std::vector<float> query, keys, values, probs, totals;
};

// The keys query `i` of a sequence of `length` rows sees: [first, end).
struct Span {
  int64_t first, end;
};
static inline Span span(int64_t i, int64_t length, int64_t window) {
  if (window <= 0) return {0, length};
  return {std::max<int64_t>(0, i - window), std::min<int64_t>(length, i + window + 1)};
}

// Head `head` of queries [q0, q0 + count) of the sequence whose rows start at `start`, into out [rows, heads, dim].
template <typename T, int64_t CHUNKS>
void attend_block(const T* q, const T* k, const T* v, T* out, const Layout& at, int64_t start, int64_t length,
                  int64_t head, int64_t q0, int64_t count, int64_t window, float scale, int64_t runtime_chunks,
                  Buffers& buf) {
  const int64_t chunks = CHUNKS ? CHUNKS : runtime_chunks, padded = chunks * LANES, dim = at.head_dim;
  const int64_t kv_head = head / at.group;
  const Span keys = {span(q0, length, window).first, span(q0 + count - 1, length, window).end};
  const int64_t n = keys.end - keys.first, tiles = (n + LANES - 1) / LANES, width = tiles * LANES;
  const int64_t rows = (count + ACCUMULATORS - 1) / ACCUMULATORS * ACCUMULATORS;  // whole micro-kernels of rows

  buf.query.assign(rows * padded, 0.f);
  for (int64_t i = 0; i < count; ++i) {
    const T* row = q + (start + q0 + i) * at.q_row + head * at.q_head;
    prefetch_head(row + PREFETCH_ROWS * at.q_row, dim);
    float* dst = buf.query.data() + i * padded;
    for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(row[d]) * scale;
  }
  buf.keys.assign(tiles * padded * LANES, 0.f);  // tile t: [padded][LANES]
  buf.values.assign(n * padded, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* key = k + (start + keys.first + j) * at.k_row + kv_head * at.k_head;
    const T* value = v + (start + keys.first + j) * at.v_row + kv_head * at.v_head;
    prefetch_head(key + PREFETCH_ROWS * at.k_row, dim);
    prefetch_head(value + PREFETCH_ROWS * at.v_row, dim);
    float* tile = buf.keys.data() + j / LANES * padded * LANES + j % LANES;
    for (int64_t d = 0; d < dim; ++d) tile[d * LANES] = to_float(key[d]);
    to_floats(value, buf.values.data() + j * padded, dim);
  }
  buf.probs.resize(rows * width);  // each query's row written below, the rows past them zero
  std::fill(buf.probs.begin() + count * width, buf.probs.end(), 0.f);
  buf.totals.resize(rows);

  // Scores, SCORE_ROWS queries at a time over the tiles any of them sees.
  for (int64_t r0 = 0; r0 < count; r0 += SCORE_ROWS) {
    const int64_t last = std::min(r0 + SCORE_ROWS, count) - 1;
    const int64_t t_first = (span(q0 + r0, length, window).first - keys.first) / LANES;
    const int64_t t_end = (span(q0 + last, length, window).end - keys.first + LANES - 1) / LANES;
    const float* query = buf.query.data() + r0 * padded;
    for (int64_t t = t_first; t < t_end; ++t) {
      const float* tile = buf.keys.data() + t * padded * LANES;
      floatv acc[SCORE_ROWS] = {};
      for (int64_t d = 0; d < (CHUNKS ? CHUNKS * LANES : padded); ++d) {
        const floatv key = *reinterpret_cast<const floatv*>(tile + d * LANES);
        for (int64_t i = 0; i < SCORE_ROWS; ++i) acc[i] += query[i * padded + d] * key;
      }
      for (int64_t i = 0; i < SCORE_ROWS; ++i)
        *reinterpret_cast<floatv*>(buf.probs.data() + (r0 + i) * width + t * LANES) = acc[i];
    }
  }
  // Each query's softmax over its own keys, unnormalized, zero elsewhere in its row: whole tiles of LANES keys, the
  // lanes outside the query's keys masked.
  for (int64_t i = 0; i < count; ++i) {
    const Span s = span(q0 + i, length, window);
    const int64_t from = s.first - keys.first, to = s.end - keys.first;
    const int64_t lo = from / LANES * LANES, hi = (to + LANES - 1) / LANES * LANES;
    float* p = buf.probs.data() + i * width;
    floatv top = p[from] + floatv{};
    for (int64_t j = lo; j < hi; j += LANES) {
      const floatv x = *reinterpret_cast<const floatv*>(p + j);
      top = lanes_within(j, from, to) & (x > top) ? x : top;
    }
    const float most = reduce_lanes(top, [](float a, float b) { return std::max(a, b); });
    floatv total = {};
    for (int64_t j = lo; j < hi; j += LANES) {
      floatv& x = *reinterpret_cast<floatv*>(p + j);
      x = lanes_within(j, from, to) ? exp_lanes<floatv, intv>(x - most) : floatv{};
      total += x;
    }
    buf.totals[i] = reduce_lanes(total, [](float a, float b) { return a + b; });
    std::fill(p, p + lo, 0.f);
    std::fill(p + hi, p + width, 0.f);
  }
  // P.V, PV_ROWS queries at a time over the values any of them sees.
  constexpr int64_t PV_ROWS = CHUNKS ? std::max<int64_t>(1, ACCUMULATORS / CHUNKS) : 1;
  constexpr int64_t ACC_CHUNKS = CHUNKS ? CHUNKS : MAX_HEAD_DIM / LANES;
  for (int64_t r0 = 0; r0 < count; r0 += PV_ROWS) {
    const int64_t m = std::min(PV_ROWS, count - r0);
    const int64_t from = span(q0 + r0, length, window).first - keys.first;
    const int64_t to = span(q0 + r0 + m - 1, length, window).end - keys.first;
    floatv acc[PV_ROWS][ACC_CHUNKS] = {};
    for (int64_t j = from; j < to; ++j) {
      const floatv* value = reinterpret_cast<const floatv*>(buf.values.data() + j * padded);
      for (int64_t i = 0; i < PV_ROWS; ++i) {
        const float p = buf.probs[(r0 + i) * width + j];
        for (int64_t c = 0; c < chunks; ++c) acc[i][c] += p * value[c];
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      T* row = out + ((start + q0 + r0 + i) * at.heads + head) * dim;
      const float* sums = reinterpret_cast<const float*>(acc[i]);
      const float total = buf.totals[r0 + i];
      for (int64_t d = 0; d < dim; ++d) row[d] = from_float<T>(sums[d] / total);
    }
  }
}

template <typename T, int64_t CHUNKS>
void attend(const T* q, const T* k, const T* v, T* out, const Layout& at, const std::vector<int64_t>& bounds,
            int64_t window, float scale) {
  const int64_t sequences = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t chunks = (at.head_dim + LANES - 1) / LANES;
  // Work items in order: sequence, then head, then block of queries; item_start[s] is sequence s's first.
  std::vector<int64_t> blocks(sequences), item_start(sequences + 1, 0);
  for (int64_t s = 0; s < sequences; ++s) {
    blocks[s] = (bounds[s + 1] - bounds[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
    item_start[s + 1] = item_start[s] + at.heads * blocks[s];
  }
  at::parallel_for(0, item_start[sequences], 1, [&](int64_t begin, int64_t end) {
    Buffers buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const int64_t head = (item - item_start[s]) / blocks[s], block = (item - item_start[s]) % blocks[s];
      const int64_t length = bounds[s + 1] - bounds[s], q0 = block * QUERY_BLOCK;
      attend_block<T, CHUNKS>(q, k, v, out, at, bounds[s], length, head, q0, std::min(QUERY_BLOCK, length - q0),
                              window, scale, chunks, buf);
    }
  });
}

}  // namespace

at::Tensor bidirectional_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cu_seqlens, double scale,
                                   int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q, k, v must be [rows, heads, head_dim]");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0,
              "k and v must have q's rows and head_dim, and a number of heads dividing q's");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v of one dtype");
  TORCH_CHECK(q.size(2) <= MAX_HEAD_DIM, nanovllm::message("head_dim above ", MAX_HEAD_DIM));
  q = q.stride(2) == 1 ? q : q.contiguous();
  k = k.stride(2) == 1 ? k : k.contiguous();
  v = v.stride(2) == 1 ? v : v.contiguous();
  const auto cu = cu_seqlens.to(at::kLong).contiguous();
  const std::vector<int64_t> bounds(cu.data_ptr<int64_t>(), cu.data_ptr<int64_t>() + cu.numel());
  TORCH_CHECK(!bounds.empty() && bounds.front() == 0 && bounds.back() <= q.size(0) &&
                  std::is_sorted(bounds.begin(), bounds.end()),
              "cu_seqlens must rise from 0 to at most q's rows");
  const Layout layout{q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      q.size(1),   q.size(1) / k.size(1), q.size(2)};
  auto out = q.new_zeros({q.size(0), q.size(1), q.size(2)});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "bidirectional_attention", [&] {
    const int64_t chunks = (q.size(2) + LANES - 1) / LANES;
    auto run = chunks == 2 ? attend<scalar_t, 2> : chunks == 4 ? attend<scalar_t, 4>
             : chunks == 8 ? attend<scalar_t, 8> : attend<scalar_t, 0>;
    run(q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
        out.data_ptr<scalar_t>(), layout, bounds, window, static_cast<float>(scale));
  });
  return out;
}
