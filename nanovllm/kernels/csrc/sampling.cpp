// The sampler's draws on the CPU, a row at a time over its logits instead of a dozen torch operators over the
// vocabulary (`execution/sampling_ops.py` computes the same in torch): a row's greedy token, and a row's token drawn
// under temperature, min-p, top-k and top-p. Rows split over torch's threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The first i in [0, n) with is(row[i]) (there is one), 64 values tested at a time.
template <typename F>
int64_t first_where(const float* row, int64_t n, const F& is) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t j = i; j < i + 64; ++j) hit |= is(row[j]);
    if (hit) break;
  }
  while (!is(row[i])) ++i;
  return i;
}

struct Token {
  float value;  // the scaled logit
  int32_t index;
};

// Per thread: a row's scaled logits, their weights exp(scaled - max) (0: dropped), the candidates, block sums.
struct Scratch {
  std::vector<float> scaled, weights;
  std::vector<Token> tokens;
  std::vector<double> sums;
};

// The first i whose cumulative weight (in order, summed in float64 by blocks of 64) exceeds u times the total, a
// token of nonzero weight.
int64_t draw_index(const float* weights, int64_t n, double u, std::vector<double>& sums) {
  constexpr int64_t BLOCK = 64;
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  sums.resize(blocks);
  double total = 0.;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * BLOCK);
    double sum = 0.;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = b * BLOCK; i < end; ++i) sum += weights[i];
    total += sums[b] = sum;
  }
  const double target = u * total;
  double cumulative = 0.;
  int64_t b = 0;
  while (b + 1 < blocks && cumulative + sums[b] <= target) cumulative += sums[b++];
  for (int64_t i = b * BLOCK; i < n; ++i)
    if (weights[i] > 0.f && (cumulative += weights[i]) > target) return i;
  int64_t last = n - 1;  // rounding left the target at the end: the last token of nonzero weight
  while (last > 0 && weights[last] == 0.f) --last;
  return last;
}

// scratch.tokens: those of nonzero weight within `nats` of the largest scaled logit `top`, in vocabulary order; 64
// values tested at a time (few blocks hold any).
void candidates(Scratch& scratch, int64_t n, float top, float nats) {
  const float* scaled = scratch.scaled.data();
  const float* weights = scratch.weights.data();
  const float lowest = top - nats;
  auto& tokens = scratch.tokens;
  tokens.clear();
  for (int64_t i0 = 0; i0 < n; i0 += 64) {
    const int64_t i1 = std::min(n, i0 + 64);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = i0; i < i1; ++i) hit |= (weights[i] > 0.f) & (scaled[i] >= lowest);
    if (hit)
      for (int64_t i = i0; i < i1; ++i)
        if (weights[i] > 0.f && scaled[i] >= lowest) tokens.push_back({scaled[i], static_cast<int32_t>(i)});
  }
}

bool more_likely(const Token& a, const Token& b) { return a.value > b.value; }

double weight_of(const std::vector<Token>& tokens, const float* weights) {
  double total = 0.;
  for (const auto& t : tokens) total += weights[t.index];
  return total;
}

// Row `x`'s token (n logits) at uniform draw `u` in [0, 1), as `Sampler._truncated` then `draw_tokens` draw it on the
// CPU: scaled = x / temperature; min-p drops scaled < max + log(min_p) (min_p 0: none); top-k (0 < k < n) keeps the
// values at least the k-th largest; top-p (< 1) drops, in ascending order, the tokens whose cumulative probability is
// at most 1 - top_p, never the most likely; then the first token (in vocabulary order) whose cumulative weight
// exceeds u times the total. Only the tokens near the top are sorted: those within 2 nats of the largest, else 4, 8,
// 16, 32, else all, the first window that holds top_k tokens or top_p of the weight (top-p never needs more than 32
// nats: what lies below weighs less than 49,152 x e^-32 of the top's). The same tokens as the torch ops up to which of
// equal logits a boundary keeps and to rounding.
int64_t sample_row(const float* x, int64_t n, float temperature, float min_p, int64_t top_k, float top_p, double u,
                   Scratch& scratch) {
  scratch.scaled.resize(n);
  scratch.weights.resize(n);
  float* scaled = scratch.scaled.data();
  float* weights = scratch.weights.data();
  float top = NEG_INF;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) {
    scaled[i] = x[i] / temperature;
    top = scaled[i] > top ? scaled[i] : top;
  }
  const float floor = min_p > 0.f ? top + std::log(min_p) : NEG_INF;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float below = scaled[i] - top;  // where torch's float32 softmax gives 0 (-inf: a masked token), so does this
    const float weight = exp_clamped(below);
    weights[i] = (scaled[i] >= floor) & (below >= -87.f) ? weight : 0.f;
    sum += weights[i];
  }
  const double total = sum;
  const bool by_k = top_k > 0 && top_k < n, by_p = top_p < 1.f;
  if (!by_k && !by_p) return draw_index(weights, n, u, scratch.sums);
  auto& tokens = scratch.tokens;
  double near = 0.;  // the candidates' weight
  for (const float nats : {2.f, 4.f, 8.f, 16.f, 32.f, std::numeric_limits<float>::infinity()}) {
    candidates(scratch, n, top, nats);
    near = weight_of(tokens, weights);
    if (by_k ? static_cast<int64_t>(tokens.size()) >= top_k : near >= top_p * total) break;
  }
  double kept = total;  // the truncated distribution's weight
  if (by_k) {
    if (static_cast<int64_t>(tokens.size()) > top_k) {
      std::nth_element(tokens.begin(), tokens.begin() + top_k - 1, tokens.end(), more_likely);
      const float kth = tokens[top_k - 1].value;  // ties with it are kept
      tokens.erase(std::partition(tokens.begin(), tokens.end(), [kth](const Token& t) { return t.value >= kth; }),
                   tokens.end());
    }
    kept = near = weight_of(tokens, weights);
  }
  if (by_p) {
    std::sort(tokens.begin(), tokens.end(), more_likely);
    double cumulative = std::max(kept - near, 0.);  // the weight below the candidates
    const double drop_at = (1. - top_p) * kept;
    size_t keep = tokens.size();
    while (keep > 1 && (cumulative += weights[tokens[keep - 1].index]) <= drop_at) --keep;
    tokens.resize(keep);
  }
  std::sort(tokens.begin(), tokens.end(), [](const Token& a, const Token& b) { return a.index < b.index; });
  const double target = u * weight_of(tokens, weights);
  double cumulative = 0.;
  for (const auto& t : tokens)
    if ((cumulative += weights[t.index]) > target) return t.index;
  return tokens.back().index;
}

}  // namespace

// Each row's index of its largest value, as torch.argmax(dim=-1) finds it (the first of equal maxima; the first NaN
// where a row has one), for float32 rows `[rows, n]`: a vectorized maximum, then a vectorized scan for its first
// index (torch's argmax took 29 us for a row of 49,152 on this machine's CPU, this 3 us).
at::Tensor greedy_tokens(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "greedy_tokens: the logits must be float32 [rows, vocabulary]");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = logits.new_empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.const_data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * n;
      float top = NEG_INF;
      int nans = 0;
#pragma omp simd reduction(max : top) reduction(| : nans)
      for (int64_t i = 0; i < n; ++i) {
        top = row[i] > top ? row[i] : top;
        nans |= row[i] != row[i];
      }
      tokens[r] = nans ? first_where(row, n, [](float v) { return v != v; })
                       : first_where(row, n, [top](float v) { return v == top; });
    }
  });
  return out;
}

// Each row's token drawn from float32 logits `[rows, n]` at `uniform[row]` (float64, in [0, 1)) under its
// temperature (> 0), min-p (0: none), top-k (0: none) and top-p (1: none): `sample_row`.
at::Tensor sample_tokens(at::Tensor logits, at::Tensor temperature, at::Tensor min_p, at::Tensor top_k,
                         at::Tensor top_p, at::Tensor uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_tokens: the logits must be float32 [rows, vocabulary]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && min_p.scalar_type() == at::kFloat &&
                  top_k.scalar_type() == at::kLong && top_p.scalar_type() == at::kFloat &&
                  uniform.scalar_type() == at::kDouble && temperature.numel() == rows && min_p.numel() == rows &&
                  top_k.numel() == rows && top_p.numel() == rows && uniform.numel() == rows,
              "sample_tokens: one float32 temperature, min-p and top-p, int64 top-k and float64 uniform per row");
  logits = logits.contiguous();
  temperature = temperature.contiguous(), min_p = min_p.contiguous(), top_k = top_k.contiguous();
  top_p = top_p.contiguous(), uniform = uniform.contiguous();
  auto out = logits.new_empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.const_data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    static thread_local Scratch scratch;  // kept: fresh buffers of a vocabulary's size are fresh pages every step
    for (int64_t r = begin; r < end; ++r)
      tokens[r] = sample_row(x + r * n, n, temperature.const_data_ptr<float>()[r], min_p.const_data_ptr<float>()[r],
                             top_k.const_data_ptr<int64_t>()[r], top_p.const_data_ptr<float>()[r],
                             uniform.const_data_ptr<double>()[r], scratch);
  });
  return out;
}
