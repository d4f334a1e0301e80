// Paged decode attention on the CPU: every single-query row of a step in one call, reading K/V in place
// through the block tables. One work item per (row, KV head, chunk of CHUNK keys): the group's query heads against
// the chunk's cached keys (with a sliding window, only the last `window` keys count; the blocks before them are never
// read), scores in float32, capped by softcap * tanh(score / softcap) where softcap > 0, a max-subtracted softmax and
// the weighted sum of V; then each head's chunks are merged as flash-decoding merges them. A row's result depends only
// on its own query, its own cached K/V and this binary's fixed operation order: not on its batch, nor on threads.
// Common head sizes are compiled with head_dim as a constant, which the compiler unrolls (about 2x faster); there a
// chunk's keys are scored 16 at a time for up to 3 heads (bfloat16 queries by the CPU's bfloat16 pair products where
// it has them), K and V asked for ahead of their use, and V weighted once per token for up to 4 heads in registers:
// 2x faster over 4,096 cached tokens than one head at a time (with bfloat16 queries, two tokens at a time by the same
// pair products, where the CPU also permutes bytes by table: AVX512-VBMI). The cache holds the queries' dtype T, or
// 8-bit floats C (`kv_cache_dtype="fp8"`), each value read back exactly as it is loaded; there K lies in tiles of 16
// tokens (`KEY_TILE` in cpu_math.h), scored a value of 16 keys at a time with no sums across lanes, twice as fast as
// keys in rows, whose products it sums in another order (the same results to rounding). An int8 cache
// (`kv_cache_dtype="int8"`, `Int8Scaled`) keeps V in tiles too, each tile's scales after it: K's scale each tile's
// scores, V's its softmax weights.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "check.h"
#include "cpu_math.h"
#include "cpu_ops.h"

// Keys per work item: a row's keys are split at fixed points, every CHUNK keys from the first it sees, whatever its
// batch or the threads, so that a long context at batch 1 keeps both cores busy and a chunk's values stay in the
// cache while each head of the group reads them.
constexpr int64_t CHUNK = 256;

#if defined(__GNUC__) && !defined(__clang__)
// Scores 16 keys at a time with GCC's vector types (AVX-512 registers, or two AVX2 ones): each key's products summed
// lane-wise, then the 16 sums finished together by one tree of shuffles and additions instead of 16 horizontal
// reductions. Every key goes through the same operations, wherever it falls in its tile.
#define NANOVLLM_TILED_SCORES 1
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// The CPU's own float vectors, for loops that keep their data in registers: GCC's 16-float vectors are one AVX-512
// register, but on AVX2 two whose arithmetic went through memory (V weighted 3x slower than with these).
#if defined(__AVX512F__)
using Lanes = f32x16;
using Ints = i32x16;
#else
typedef float Lanes __attribute__((vector_size(32), aligned(4)));
typedef int32_t Ints __attribute__((vector_size(32)));
#endif
constexpr int64_t LANES = sizeof(Lanes) / sizeof(float);

// LANES values from `in` as floats (8-bit ones by the CPU's float16 instructions where it has them; an int8 cache's
// signed magnitudes, unscaled, by its integer ones).
template <typename C>
static inline Lanes to_lanes(const C* in) {
  if constexpr (std::is_same_v<C, float>) {
    return *reinterpret_cast<const Lanes*>(in);
#if defined(__AVX2__)
  } else if constexpr (std::is_same_v<C, Int8Scaled>) {  // the magnitude as a float, the sign bit put in its place
#if defined(__AVX512F__)
    const Ints x = (Ints)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)));
#else
    const Ints x = (Ints)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in)));
#endif
    const Lanes magnitude = __builtin_convertvector(x & 0x7F, Lanes);
    const Ints bits = reinterpret_cast<const Ints&>(magnitude) | (x & 0x80) << 24;
    return reinterpret_cast<const Lanes&>(bits);
#endif
#if defined(__AVX512F__)
  } else if constexpr (sizeof(C) == 1) {
    return (Lanes)fp8_lanes16(in);
#elif defined(__AVX2__) && defined(__F16C__)
  } else if constexpr (sizeof(C) == 1) {
    return (Lanes)fp8_lanes8(in);
#endif
  } else {
    alignas(64) float x[LANES];
    to_floats(in, x, LANES);
    return *reinterpret_cast<const Lanes*>(x);
  }
}

// The first step of summing 16 vectors' lanes: lanes 0-7 of the result hold a's pairwise sums, 8-15 b's.
static inline f32x16 half_sums(f32x16 a, f32x16 b) {
  const i32x16 lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i32x16 hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// Lane i of the result: the sum of the lanes of v[i], given r[i] = half_sums(v[i], v[i + 8]).
static inline f32x16 lane_sums(const f32x16 r[8]) {
  const i32x16 lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const i32x16 hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const i32x16 lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const i32x16 hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const i32x16 lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const i32x16 hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  f32x16 s[4], t[2];
  for (int i = 0; i < 4; ++i) s[i] = __builtin_shuffle(r[i], r[i + 4], lo2) + __builtin_shuffle(r[i], r[i + 4], hi2);
  for (int i = 0; i < 2; ++i) t[i] = __builtin_shuffle(s[i], s[i + 2], lo3) + __builtin_shuffle(s[i], s[i + 2], hi3);
  return __builtin_shuffle(t[0], t[1], lo4) + __builtin_shuffle(t[0], t[1], hi4);
}

// Tokens whose K and V a work item asks for ahead of their keys' scores: the hardware's prefetchers miss a head's
// slices of the cache, a token's width apart (a work item over 4,096 cached tokens read them twice as slowly).
constexpr int64_t PREFETCH_TOKENS = 32;

// Lane i of the 16 (or of a vector V's lanes) summed: query . key, for HEAD_DIM values of the dot products' operand
// type: float, or bfloat16 where the CPU multiplies pairs of them into float sums (AVX512-BF16: exact products, half
// the instructions).
template <int64_t HEAD_DIM, typename V = f32x16>
static inline V dot_lanes(const float* query, const float* key) {
  constexpr int64_t N = sizeof(V) / sizeof(float);
  const auto at = [](const float* p, int64_t c) {  // by memcpy: V, a template argument, lost its typedef's alignment
    V v;
    std::memcpy(&v, p + N * c, sizeof v);
    return v;
  };
  V acc = at(query, 0) * at(key, 0);
  for (int64_t c = 1; c < HEAD_DIM / N; ++c) acc += at(query, c) * at(key, c);
  return acc;
}
#if defined(__AVX512BF16__)
template <int64_t HEAD_DIM>
static inline f32x16 dot_lanes(const c10::BFloat16* query, const c10::BFloat16* key) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < HEAD_DIM / 32; ++c)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(query + 32 * c),
                           (__m512bh)_mm512_loadu_si512(key + 32 * c));
  return (f32x16)acc;
}
#endif

#if !defined(__AVX512F__)
// `lane_sums` in 8-float registers (AVX2: GCC's 16-float vectors went through memory, 2x slower): lane i, the sum of
// v[i]'s lanes.
static inline Lanes lane_sums(const Lanes v[8]) {
  const Ints lo1 = {0, 1, 2, 3, 8, 9, 10, 11}, hi1 = {4, 5, 6, 7, 12, 13, 14, 15};
  const Ints lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const Ints lo3 = {0, 8, 2, 10, 4, 12, 6, 14}, hi3 = {1, 9, 3, 11, 5, 13, 7, 15};
  Lanes r[4], s[2];
  for (int i = 0; i < 4; ++i) r[i] = __builtin_shuffle(v[i], v[i + 4], lo1) + __builtin_shuffle(v[i], v[i + 4], hi1);
  for (int i = 0; i < 2; ++i) s[i] = __builtin_shuffle(r[i], r[i + 2], lo2) + __builtin_shuffle(r[i], r[i + 2], hi2);
  return __builtin_shuffle(s[0], s[1], lo3) + __builtin_shuffle(s[0], s[1], hi3);
}
#endif

// One tile's scores for HEADS heads from `head`: scores[h * length + j] = scale * query_h . rows[j] for the first n
// of the 16 keys.
template <int64_t HEADS, int64_t HEAD_DIM, typename Operand>
static inline void tile_scores(const Operand* query, int64_t head, const Operand* const rows[16], float scale,
                               int64_t n, float* scores, int64_t length) {
#if !defined(__AVX512F__)
  if constexpr (std::is_same_v<Operand, float>) {  // a head at a time: 8 registers of products each
    for (int64_t h = 0; h < HEADS; ++h)
      for (int64_t half = 0; half < 2; ++half) {
        Lanes dots[8];
        for (int64_t j = 0; j < 8; ++j)
          dots[j] = dot_lanes<HEAD_DIM, Lanes>(query + (head + h) * HEAD_DIM, rows[8 * half + j]);
        const Lanes sums = lane_sums(dots) * scale;
        float* out = scores + (head + h) * length + 8 * half;
        for (int64_t j = 0; j < std::min<int64_t>(8, n - 8 * half); ++j) out[j] = sums[j];
      }
    return;
  }
#endif
  f32x16 halves[HEADS][8];
  for (int64_t j = 0; j < 8; ++j)
    for (int64_t h = 0; h < HEADS; ++h) {
      const Operand* q = query + (head + h) * HEAD_DIM;
      halves[h][j] = half_sums(dot_lanes<HEAD_DIM>(q, rows[j]), dot_lanes<HEAD_DIM>(q, rows[j + 8]));
    }
  for (int64_t h = 0; h < HEADS; ++h) {
    const f32x16 sums = lane_sums(halves[h]) * scale;
    float* out = scores + (head + h) * length;
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), (__m512)sums);
#else
    for (int64_t j = 0; j < n; ++j) out[j] = sums[j];  // a memcpy of n floats: `rep movs`, 7% of the time
#endif
  }
}

// The type a group's query and keys are multiplied in: bfloat16 queries pair by pair where the CPU can, else float.
template <typename T, int64_t HEAD_DIM>
using DotOperand = std::conditional_t<
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16> && HEAD_DIM % 32 == 0,
#else
    false,
#endif
    c10::BFloat16, float>;

#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
// 8-bit floats widened to bfloat16 by table (every e4m3 and e5m2 value is a bfloat16): the low and the high bytes of
// the bfloat16s of the 128 values with the sign bit clear, two vectors each, looked up by a byte's 7 low bits
// (`vpermi2b`), the byte's sign set in the high byte, then the two interleaved: 64 values in 6 instructions, where
// widening through float16 and float32 took 28.
#define NANOVLLM_BF16_TABLES 1
template <typename C>
struct Bfloat16Table {
  __m512i low[2], high[2];
  Bfloat16Table() {
    alignas(64) uint8_t bytes[2][128];
    for (int i = 0; i < 128; ++i) {
      const float value = to_float(C(static_cast<uint8_t>(i), C::from_bits()));
      uint32_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      bytes[0][i] = static_cast<uint8_t>(bits >> 16), bytes[1][i] = static_cast<uint8_t>(bits >> 24);
    }
    for (int half = 0; half < 2; ++half)
      low[half] = _mm512_load_si512(bytes[0] + 64 * half), high[half] = _mm512_load_si512(bytes[1] + 64 * half);
  }
};
template <typename C>
static const Bfloat16Table<C> bfloat16_table;

// Permutations: `unpack_order` puts 64 bytes where the byte unpacks (which interleave each 128-bit lane's halves)
// return them in order, `pair_order(half)` the bytes 32 * half.. of two vectors side by side (a's byte, b's byte)
// where the unpacks return them as the pairs of dimensions 32 * half.. in order; `interleave_words(half)` pairs two
// vectors' 16-bit values (word 2k: the first's 16 * half + k, word 2k + 1: the second's); `tile_pairs` puts 4
// dimensions of a K tile's 16 tokens where the unpacks return them as 2 vectors of the tokens' pairs of values (lane j:
// token j's dimensions 0 and 1, then 2 and 3).
struct Permutations {
  __m512i unpack_order, pair_order[2], interleave_words[2], tile_pairs;
  Permutations() {
    alignas(64) uint8_t order[64], pairs[2][64], tiles[64];
    alignas(64) uint16_t words[2][32];
    for (int lane = 0; lane < 4; ++lane)
      for (int i = 0; i < 8; ++i) {
        const int word = 8 * lane + i;  // token word / 2, dimension word % 2 (+ 2 from unpackhi)
        tiles[16 * lane + i] = static_cast<uint8_t>(word % 2 * KEY_TILE + word / 2);
        tiles[16 * lane + 8 + i] = static_cast<uint8_t>((2 + word % 2) * KEY_TILE + word / 2);
      }
    tile_pairs = _mm512_load_si512(tiles);
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < 8; ++j) {
        order[16 * k + j] = static_cast<uint8_t>(8 * k + j);
        order[16 * k + 8 + j] = static_cast<uint8_t>(32 + 8 * k + j);
        for (int half = 0; half < 2; ++half) {  // unpacklo's dword 4k + m: bytes 16k + 2m, +1; unpackhi's: 16k + 8..
          const int dim = 32 * half + (j < 4 ? 0 : 16) + 4 * k + j % 4, at = 16 * k + (j < 4 ? 0 : 8) + 2 * (j % 4);
          pairs[half][at] = static_cast<uint8_t>(dim), pairs[half][at + 1] = static_cast<uint8_t>(64 + dim);
        }
      }
    for (int j = 0; j < 32; ++j)
      for (int half = 0; half < 2; ++half) words[half][j] = static_cast<uint16_t>(16 * half + j / 2 + (j % 2) * 32);
    unpack_order = _mm512_load_si512(order);
    for (int i = 0; i < 2; ++i)
      pair_order[i] = _mm512_load_si512(pairs[i]), interleave_words[i] = _mm512_load_si512(words[i]);
  }
};
static const Permutations permutations;

// The bfloat16s of 64 8-bit values, unpacked in their order by `_mm512_unpack{lo,hi}_epi8(low, high)`.
template <typename C>
__attribute__((always_inline)) static inline void look_up(__m512i x, __m512i& low, __m512i& high) {
  const Bfloat16Table<C>& t = bfloat16_table<C>;
  low = _mm512_permutex2var_epi8(t.low[0], x, t.low[1]);
  high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.high[0], x, t.high[1]), x,
                                   _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | sign
}

// 64 8-bit values as bfloat16, in their order: words[0] the first 32, words[1] the others.
template <typename C>
__attribute__((always_inline)) static inline void widen(__m512i values, __m512i words[2]) {
  __m512i low, high;
  look_up<C>(_mm512_permutexvar_epi8(permutations.unpack_order, values), low, high);
  words[0] = _mm512_unpacklo_epi8(low, high), words[1] = _mm512_unpackhi_epi8(low, high);
}

// The bfloat16 pairs of tokens a and b: lane k of pairs[g] holds (v_a[16g + k], v_b[16g + k]).
template <int64_t HEAD_DIM, typename C>
__attribute__((always_inline)) static inline void value_pairs(const C* a, const C* b, __m512i pairs[HEAD_DIM / 16]) {
  if constexpr (sizeof(C) == 1) {
    for (int64_t d = 0; d < HEAD_DIM; d += 64) {
      const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
      for (int half = 0; half < 2; ++half) {
        __m512i low, high;
        look_up<C>(_mm512_permutex2var_epi8(x, permutations.pair_order[half], y), low, high);
        pairs[d / 16 + 2 * half] = _mm512_unpacklo_epi8(low, high);
        pairs[d / 16 + 2 * half + 1] = _mm512_unpackhi_epi8(low, high);
      }
    }
  } else {
    for (int64_t d = 0; d < HEAD_DIM; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
      for (int h = 0; h < 2; ++h) pairs[d / 16 + h] = _mm512_permutex2var_epi16(x, permutations.interleave_words[h], y);
    }
  }
}
#endif

// fn(h, std::integral_constant<int64_t, HEADS>) for the group's heads from h, up to 3 at a time.
template <typename F>
static inline void by_three_heads(int64_t group, const F& fn) {
  for (int64_t h = 0; h < group;) {
    const int64_t heads = std::min<int64_t>(3, group - h);
    if (heads == 3) fn(h, std::integral_constant<int64_t, 3>{});
    else if (heads == 2) fn(h, std::integral_constant<int64_t, 2>{});
    else fn(h, std::integral_constant<int64_t, 1>{});
    h += heads;
  }
}

// scores[h * length + t] = scale * query_h . key_(first + t) for the group's heads and the `length` keys (rows of a
// 16-bit cache) from `first`, 16 keys per tile (a short last tile padded with 0); each token's K and V asked for
// PREFETCH_TOKENS ahead. Keys stored as the operand type are read in place, float16 ones converted once per tile.
template <typename Operand, typename C, int64_t HEAD_DIM>
static void tiled_scores(const Operand* query, float scale, const C* k_cache, const C* v_cache, const int32_t* table,
                         int64_t first, int64_t length, int64_t group, int64_t block_size, int64_t block_stride,
                         int64_t token_stride, int64_t head_offset, float* scores) {
  alignas(64) Operand keys[16][HEAD_DIM];
  alignas(64) static const Operand zeros[HEAD_DIM] = {};
  const Operand* rows[16];
  int64_t block = first / block_size, offset = first % block_size;  // where key first + t0 + j lies
  int64_t ahead = 0, ahead_block = block, ahead_offset = offset;   // the next token to ask for
  const auto prefetch_until = [&](int64_t end) {
    for (; ahead < std::min(end, length); ++ahead) {
      const int64_t at = table[ahead_block] * block_stride + ahead_offset * token_stride + head_offset;
      prefetch_head(k_cache + at, HEAD_DIM);
      prefetch_head<2>(v_cache + at, HEAD_DIM);
      if (++ahead_offset == block_size) ++ahead_block, ahead_offset = 0;
    }
  };
  for (int64_t t0 = 0; t0 < length; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, length - t0);
    prefetch_until(t0 + 16 + PREFETCH_TOKENS);
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        rows[j] = zeros;
        continue;
      }
      const C* key = k_cache + table[block] * block_stride + offset * token_stride + head_offset;
      if constexpr (std::is_same_v<C, Operand>) {
        rows[j] = key;
      } else {  // float16 keys for float queries
        to_floats(key, keys[j], HEAD_DIM);
        rows[j] = keys[j];
      }
      if (++offset == block_size) ++block, offset = 0;
    }
    by_three_heads(group, [&](int64_t h, auto heads) {  // each key read once for them
      tile_scores<decltype(heads)::value, HEAD_DIM>(query, h, rows, scale, n, scores + t0, length);
    });
  }
}

// out[h] lane j: query_h . key j of a tile (one KV head's 16 keys in an 8-bit K tile) for HEADS heads: each value of
// the 16 keys one vector (a dimension's 16 bytes, widened), made once for the HEADS heads, its products added into one
// of a few sums per head (chains the CPU overlaps), summed at the end.
template <int64_t HEADS, int64_t HEAD_DIM, typename C>
static inline void tile_dots(const float* query, const C* tile, f32x16 out[HEADS]) {
  constexpr int64_t PARTS = KEY_TILE / LANES, SUMS = PARTS == 1 ? 4 : 1;  // sums for 3 heads: 12 of 32 registers,
  Lanes sums[HEADS][PARTS][SUMS] = {};                                         // or 6 of 16 (AVX2)
  for (int64_t d = 0; d < HEAD_DIM; d += SUMS)
    for (int64_t k = 0; k < SUMS; ++k)
      for (int64_t part = 0; part < PARTS; ++part) {
        const Lanes keys = to_lanes(tile + KEY_TILE * (d + k) + LANES * part);
        for (int64_t h = 0; h < HEADS; ++h) sums[h][part][k] += keys * query[h * HEAD_DIM + d + k];
      }
  for (int64_t h = 0; h < HEADS; ++h)
    for (int64_t part = 0; part < PARTS; ++part) {
      Lanes sum = sums[h][part][0];
      for (int64_t k = 1; k < SUMS; ++k) sum += sums[h][part][k];
      std::memcpy(reinterpret_cast<Lanes*>(&out[h]) + part, &sum, sizeof sum);
    }
}
#if defined(__AVX512BF16__)
// Bfloat16 queries: the keys' pairs of values, as the CPU multiplies bfloat16 pairs, from 64 bytes (4 dimensions) at a
// time: by table where the CPU has them (their bytes paired by the same permutation that orders them for the unpacks).
template <int64_t HEADS, int64_t HEAD_DIM, typename C>
static inline void tile_dots(const c10::BFloat16* query, const C* tile, f32x16 out[HEADS]) {
  __m512 sums[HEADS][4];
  for (int64_t h = 0; h < HEADS; ++h)
    for (int64_t k = 0; k < 4; ++k) sums[h][k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < HEAD_DIM; d += 8) {  // pairs d / 2 .. d / 2 + 3
    __m512i pairs[4];
    for (int64_t k = 0; k < 2; ++k) {
      const C* values = tile + KEY_TILE * (d + 4 * k);
#ifdef NANOVLLM_BF16_TABLES
      __m512i low, high;
      look_up<C>(_mm512_permutexvar_epi8(permutations.tile_pairs, _mm512_loadu_si512(values)), low, high);
      pairs[2 * k] = _mm512_unpacklo_epi8(low, high), pairs[2 * k + 1] = _mm512_unpackhi_epi8(low, high);
#else
      alignas(64) static constexpr uint16_t by_token[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22,
                                                            7, 23, 8, 24, 9,  25, 10, 26, 11, 27, 12, 28, 13, 29,
                                                            14, 30, 15, 31};
      alignas(64) float x[4][KEY_TILE];
      to_floats(values, x[0], 4 * KEY_TILE);
      for (int64_t e = 0; e < 2; ++e) {  // dimensions 2e and 2e + 1 as bfloat16 (exactly), then paired by token
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_load_ps(x[2 * e + 1]), _mm512_load_ps(x[2 * e]));
        pairs[2 * k + e] = _mm512_permutexvar_epi16(_mm512_load_si512(by_token), (__m512i)both);
      }
#endif
    }
    for (int64_t h = 0; h < HEADS; ++h)
      for (int64_t k = 0; k < 4; ++k) {
        int32_t pair;
        std::memcpy(&pair, query + h * HEAD_DIM + d + 2 * k, sizeof pair);
        sums[h][k] = _mm512_dpbf16_ps(sums[h][k], (__m512bh)pairs[k], (__m512bh)_mm512_set1_epi32(pair));
      }
  }
  for (int64_t h = 0; h < HEADS; ++h)
    out[h] = (f32x16)_mm512_add_ps(_mm512_add_ps(sums[h][0], sums[h][1]), _mm512_add_ps(sums[h][2], sums[h][3]));
}
#endif

// Tiles whose keys a work item asks for ahead of their scores (a tile of one head is contiguous, but the blocks are
// scattered).
constexpr int64_t PREFETCH_TILES = 4;

// `tiled_scores` for an 8-bit cache's tiled K (g: the KV head): each tile's keys widened once for the group's heads.
// A tile the keys [first, first + length) cover in part gives the scores of its keys in the range only. An int8
// cache's V scales are read here too, into value_scales[t] (its V tile asked for with K's, its scales read as K's
// are: a pass of their own after the scores waited on each tile, 45 us a layer over 4,096 tokens).
template <typename Operand, typename C, int64_t HEAD_DIM>
static void tiled_key_scores(const Operand* query, float scale, const C* k_cache, const C* v_cache,
                             const int32_t* table, int64_t first, int64_t length, int64_t group, int64_t block_size,
                             int64_t block_stride, int64_t token_stride, int64_t g, float* scores,
                             float* value_scales) {
  constexpr int64_t WIDTH = row_width<C>(HEAD_DIM);
  const auto tile_at = [&](int64_t t) {  // t: a multiple of KEY_TILE
    return k_cache + table[t / block_size] * block_stride + t % block_size * token_stride + g * KEY_TILE * WIDTH;
  };
  const int64_t end = first + length;
  int64_t ahead = first, ahead_block = first / block_size, ahead_offset = first % block_size;  // the next V to ask for
  for (int64_t t0 = first - first % KEY_TILE; t0 < end; t0 += KEY_TILE) {
    if (const int64_t next = t0 + PREFETCH_TILES * KEY_TILE; next < end) {
      prefetch_head(tile_at(next), KEY_TILE * WIDTH);
      if constexpr (std::is_same_v<C, Int8Scaled>)  // V's tile, where K's lies in its cache
        prefetch_head<2>(v_cache + (tile_at(next) - k_cache), KEY_TILE * WIDTH);
    }
    for (; ahead < std::min(end, t0 + KEY_TILE + PREFETCH_TOKENS) && !std::is_same_v<C, Int8Scaled>; ++ahead) {
      prefetch_head<2>(v_cache + table[ahead_block] * block_stride + ahead_offset * token_stride + g * WIDTH, WIDTH);
      if (++ahead_offset == block_size) ++ahead_block, ahead_offset = 0;
    }
    const C* tile = tile_at(t0);
    const int64_t from = std::max(first, t0), to = std::min(end, t0 + KEY_TILE);
    f32x16 scales = f32x16{} + scale;  // each key's scores' scale (an int8 key's own too)
    if constexpr (std::is_same_v<C, Int8Scaled>) {
      f32x16 own;
      std::memcpy(&own, tile_scale(tile, HEAD_DIM, 0), sizeof own);
      scales *= own;
      const float* values = reinterpret_cast<const float*>(tile_scale(v_cache + (tile - k_cache), HEAD_DIM, 0));
      std::copy(values + from - t0, values + to - t0, value_scales + from - first);
    }
    by_three_heads(group, [&](int64_t h, auto heads) {  // each tile widened once for them
      constexpr int64_t HEADS = decltype(heads)::value;
      f32x16 dots[HEADS];
      tile_dots<HEADS, HEAD_DIM>(query + h * HEAD_DIM, tile, dots);
      for (int64_t k = 0; k < HEADS; ++k) {
        const f32x16 scaled = dots[k] * scales;
        float* out = scores + (h + k) * length;
        if (to - from == KEY_TILE)
          *reinterpret_cast<f32x16*>(out + t0 - first) = scaled;
        else
          for (int64_t t = from; t < to; ++t) out[t - first] = scaled[t - t0];
      }
    });
  }
}

// The weighted sums of V for HEADS heads of the group from `head` (weights[h * (to - from) + t], into partial's rows),
// kept in registers: each token's V converted to floats once for all of them, then added token by token; as many
// dimensions at a time as 16 registers (AVX2: 12 of its 16) hold sums of for the HEADS heads (AVX2: 32 for 3 heads,
// each token's V read in two passes).
static constexpr int64_t value_slice(int64_t heads, int64_t head_dim) {
  int64_t slice = head_dim;
  while (heads * slice > (LANES == 16 ? 16 : 12) * LANES && slice > LANES) slice /= 2;
  return slice;
}
template <int64_t HEADS, typename C, int64_t HEAD_DIM>
static void weighted_values(const C* v_cache, const int32_t* table, int64_t head, int64_t from, int64_t to,
                            int64_t block_size, int64_t kv_heads, int64_t g, const float* weights, float* partial) {
  constexpr int64_t SLICE = value_slice(HEADS, HEAD_DIM), PARTS = SLICE / LANES;
  const int64_t length = to - from;
  for (int64_t d0 = 0; d0 < HEAD_DIM; d0 += SLICE) {
    Lanes acc[HEADS][PARTS] = {};
    for (int64_t t0 = from - from % block_size; t0 < to; t0 += block_size) {
      const int64_t block = table[t0 / block_size] * block_size - t0;  // + t: token t's slot
      for (int64_t t = std::max(t0, from); t < std::min(t0 + block_size, to); ++t) {
        const C* row = v_cache + value_offset<C>(block + t, g, kv_heads, HEAD_DIM) + d0;
        Lanes v[PARTS];
        for (int64_t p = 0; p < PARTS; ++p) v[p] = to_lanes(row + LANES * p);
        for (int64_t h = 0; h < HEADS; ++h) {
          const float w = weights[(head + h) * length + t - from];
          for (int64_t p = 0; p < PARTS; ++p) acc[h][p] += w * v[p];
        }
      }
    }
    for (int64_t h = 0; h < HEADS; ++h)
      std::memcpy(partial + (head + h) * (HEAD_DIM + 2) + d0, acc[h], SLICE * sizeof(float));
  }
}

#ifdef NANOVLLM_BF16_TABLES
// weighted_values by bfloat16 pair products, for queries whose keys were dotted in bfloat16 too: two tokens at a time,
// lane k the pair (v_t[d], v_t+1[d]) times the pair of their weights rounded to bfloat16 (as flash attention rounds
// its probabilities for the products; their sum stays in float32): half the products' instructions, and an 8-bit V
// widened by table. The same pairs from an 8-bit cache and from a 16-bit one holding its values.
template <int64_t HEADS, typename C, int64_t HEAD_DIM>
static void weighted_value_pairs(const C* v_cache, const int32_t* table, int64_t head, int64_t from, int64_t to,
                                 int64_t block_size, int64_t kv_heads, int64_t g, const float* weights,
                                 float* partial) {
  constexpr int64_t GROUPS = HEAD_DIM / 16;
  const int64_t length = to - from;
  alignas(64) static const C zeros[HEAD_DIM] = {};
  alignas(64) uint16_t pair_weights[HEADS][CHUNK + 16];  // bfloat16, zero past `length`
  for (int64_t h = 0; h < HEADS; ++h)
    for (int64_t t = 0; t < length; t += 16) {
      const __mmask16 valid = static_cast<__mmask16>(length - t >= 16 ? 0xFFFF : (1u << (length - t)) - 1);
      const __m512 w = _mm512_maskz_loadu_ps(valid, weights + (head + h) * length + t);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pair_weights[h] + t), (__m256i)_mm512_cvtneps_pbh(w));
    }
  __m512 acc[HEADS][GROUPS];
  for (int64_t h = 0; h < HEADS; ++h)
    for (int64_t k = 0; k < GROUPS; ++k) acc[h][k] = _mm512_setzero_ps();
  int64_t block = from / block_size, offset = from % block_size;
  const auto next = [&]() {
    const C* v = v_cache + value_offset<C>(table[block] * block_size + offset, g, kv_heads, HEAD_DIM);
    if (++offset == block_size) ++block, offset = 0;
    return v;
  };
  for (int64_t t = 0; t < length; t += 2) {
    const C* a = next();
    const C* b = t + 1 < length ? next() : zeros;
    __m512i pairs[GROUPS];
    value_pairs<HEAD_DIM>(a, b, pairs);
    for (int64_t h = 0; h < HEADS; ++h) {
      int32_t both;
      std::memcpy(&both, pair_weights[h] + t, sizeof both);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(both);
      for (int64_t k = 0; k < GROUPS; ++k) acc[h][k] = _mm512_dpbf16_ps(acc[h][k], (__m512bh)pairs[k], w);
    }
  }
  for (int64_t h = 0; h < HEADS; ++h)
    for (int64_t k = 0; k < GROUPS; ++k) _mm512_storeu_ps(partial + (head + h) * (HEAD_DIM + 2) + 16 * k, acc[h][k]);
}
#endif

// weighted_values for all the group's heads, as many at a time as 16 registers hold (at most 4); by pair products
// where `PAIRS`.
template <typename C, int64_t HEAD_DIM, bool PAIRS>
static void group_values(const C* v_cache, const int32_t* table, int64_t from, int64_t to, int64_t group,
                         int64_t block_size, int64_t kv_heads, int64_t g, const float* weights, float* partial) {
  constexpr int64_t MOST = std::clamp<int64_t>(256 / HEAD_DIM, 1, 4);
  for (int64_t head = 0; head < group;) {
    const int64_t heads = std::min(MOST, group - head);
    const auto run = [&](auto n) {
#ifdef NANOVLLM_BF16_TABLES
      if constexpr (PAIRS) {
        weighted_value_pairs<decltype(n)::value, C, HEAD_DIM>(v_cache, table, head, from, to, block_size, kv_heads,
                                                             g, weights, partial);
        return;
      }
#endif
      weighted_values<decltype(n)::value, C, HEAD_DIM>(v_cache, table, head, from, to, block_size, kv_heads, g,
                                                      weights, partial);
    };
    if (heads == 4) {
      if constexpr (MOST >= 4) run(std::integral_constant<int64_t, 4>{});
    } else if (heads == 3) {
      if constexpr (MOST >= 3) run(std::integral_constant<int64_t, 3>{});
    } else if (heads == 2) {
      if constexpr (MOST >= 2) run(std::integral_constant<int64_t, 2>{});
    } else {
      run(std::integral_constant<int64_t, 1>{});
    }
    head += heads;
  }
}
#endif

// The weighted sums of an 8-bit cache's V for the group's heads (weights[h * (to - from) + t], into partial's rows):
// every VALUE_TILE tokens converted once into `values`, which stays in L1, then each head adds its share of them,
// token by token in the order the 16-bit path adds them (converting a token's V once per head cost more than the
// halved reads saved).
constexpr int64_t VALUE_TILE = 16;
template <typename C, int64_t HEAD_DIM>
static void eight_bit_values(const C* v_cache, const int32_t* table, int64_t g, int64_t from, int64_t to,
                             int64_t group, int64_t runtime_head_dim, int64_t block_size, int64_t kv_heads,
                             const float* weights, float* values, float* partial) {
  const int64_t head_dim = HEAD_DIM ? HEAD_DIM : runtime_head_dim, length = to - from;
  for (int64_t h = 0; h < group; ++h) std::fill_n(partial + h * (head_dim + 2), head_dim, 0.f);
  for (int64_t t0 = from; t0 < to; t0 += VALUE_TILE) {
    const int64_t n = std::min<int64_t>(VALUE_TILE, to - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      to_floats(v_cache + value_offset<C>(table[t / block_size] * block_size + t % block_size, g, kv_heads, head_dim),
                values + j * head_dim, head_dim);
    }
    for (int64_t h = 0; h < group; ++h) {
      const float* p = weights + h * length + (t0 - from);
      float* out = partial + h * (head_dim + 2);
      for (int64_t j = 0; j < n; ++j) {
        const float* v = values + j * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) out[d] += p[j] * v[d];
      }
    }
  }
}

// The largest of n floats, 16 lanes at a time (GCC leaves a max reduction scalar: a quarter of a work item's time).
static inline float largest(const float* p, int64_t n) {
  float lanes[16];
  std::fill_n(lanes, 16, -std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16)
    for (int64_t i = 0; i < 16; ++i) lanes[i] = std::max(lanes[i], p[t + i]);
  for (; t < n; ++t) lanes[0] = std::max(lanes[0], p[t]);
  return *std::max_element(lanes, lanes + 16);
}

// p[t] = exp(p[t] - top) for n scores at most `top`; returns their sum.
static inline float exponentials(float* p, int64_t n, float top) {
#ifdef NANOVLLM_TILED_SCORES
  Lanes sums = {};
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES) {
    Lanes& x = *reinterpret_cast<Lanes*>(p + t);
    x = exp_lanes<Lanes, Ints>(x - top);
    sums += x;
  }
  if (t < n) {  // a short last tile: its other lanes neither stored nor summed
    Lanes x = {};
    std::memcpy(&x, p + t, (n - t) * sizeof(float));
    x = exp_lanes<Lanes, Ints>(x - top);
    for (int64_t i = 0; t + i < n; ++i) p[t + i] = x[i], sums[i] += x[i];
  }
  float total = 0.f;
  for (int i = 0; i < LANES; ++i) total += sums[i];
  return total;
#else
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) total += p[t] = exp_clamped(p[t] - top);
  return total;
#endif
}

// One work item: the group's query heads of one row against the keys [from, to) of one KV head. Per head it leaves
// the unnormalized weighted sum of V (head_dim floats), then the scores' maximum and the sum of their exponentials.
template <typename T, typename C, int64_t HEAD_DIM>
static void decode_chunk(const T* q, const C* k_cache, const C* v_cache, const int32_t* table, int64_t row,
                         int64_t g, int64_t from, int64_t to, int64_t heads, int64_t group, int64_t head_dim,
                         int64_t block_size, int64_t block_stride, int64_t token_stride, float scale, float softcap,
                         std::vector<float>& query, std::vector<float>& scores, std::vector<float>& floats,
                         std::vector<float>& values, float* partial) {
  const int64_t length = to - from, width = row_width<C>(head_dim), kv_heads = token_stride / width;
#ifdef NANOVLLM_TILED_SCORES
  constexpr bool bf16_dots = HEAD_DIM > 0 && !std::is_same_v<DotOperand<T, HEAD_DIM>, float>;
#else
  constexpr bool bf16_dots = false;
#endif
  if constexpr (!bf16_dots)  // the queries as floats, scaled (bfloat16 pair products take them as they are)
    for (int64_t h = 0; h < group; ++h)
      for (int64_t d = 0; d < head_dim; ++d)
        query[h * head_dim + d] = to_float(q[(row * heads + g * group + h) * head_dim + d]) * scale;
#ifdef NANOVLLM_TILED_SCORES
  if constexpr (HEAD_DIM % 16 == 0 && HEAD_DIM > 0) {
    using Operand = DotOperand<T, HEAD_DIM>;
    const Operand* group_query;
    float after = 1.f;  // the scale, applied to the scores of queries read as they are
    if constexpr (std::is_same_v<Operand, float>)
      group_query = query.data();
    else
      group_query = q + (row * heads + g * group) * head_dim, after = scale;
    if constexpr (sizeof(C) == 1)
      tiled_key_scores<Operand, C, HEAD_DIM>(group_query, after, k_cache, v_cache, table, from, length, group,
                                             block_size, block_stride, token_stride, g, scores.data(),
                                             floats.data());
    else
      tiled_scores<Operand, C, HEAD_DIM>(group_query, after, k_cache, v_cache, table, from, length, group,
                                         block_size, block_stride, token_stride, g * width, scores.data());
  } else
#endif
  for (int64_t t0 = from - from % block_size; t0 < to; t0 += block_size) {
    for (int64_t t = std::max(t0, from); t < std::min(t0 + block_size, to); ++t) {
      key_to_floats(k_cache, table[t0 / block_size] * block_size + t - t0, g, kv_heads, head_dim, floats.data());
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = query.data() + h * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * floats[d];
        scores[h * length + t - from] = dot;
      }
    }
  }
  if (softcap > 0.f)
    for (int64_t i = 0; i < group * length; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t h = 0; h < group; ++h) {
    float* p = scores.data() + h * length;
    const float top = largest(p, length);
    const float total = exponentials(p, length, top);
    float* out = partial + h * (head_dim + 2);
    out[head_dim] = top;
    out[head_dim + 1] = total;
  }
  if constexpr (std::is_same_v<C, Int8Scaled>) {  // an int8 V's scales, in its weights
#ifdef NANOVLLM_TILED_SCORES
    if constexpr (HEAD_DIM % 16 == 0 && HEAD_DIM > 0) {
      for (int64_t h = 0; h < group; ++h) {
        float* p = scores.data() + h * length;
#pragma omp simd
        for (int64_t t = 0; t < length; ++t) p[t] *= floats[t];
      }
    } else
#endif
    for (int64_t t0 = from - from % block_size; t0 < to; t0 += block_size) {
      const int64_t block = table[t0 / block_size] * block_size - t0;  // + t: token t's slot
      for (int64_t t = std::max(t0, from); t < std::min(t0 + block_size, to); ++t) {
        const int64_t j = (block + t) % KEY_TILE;
        const C* tile = v_cache + value_offset<C>(block + t - j, g, kv_heads, head_dim);
        const float s = scale_at(tile_scale(tile, head_dim, j));
        for (int64_t h = 0; h < group; ++h) scores[h * length + t - from] *= s;
      }
    }
  }
#ifdef NANOVLLM_TILED_SCORES
  if constexpr (HEAD_DIM % 16 == 0 && HEAD_DIM > 0) {
#ifdef NANOVLLM_BF16_TABLES
    constexpr bool pairs = bf16_dots && HEAD_DIM % 64 == 0;
#else
    constexpr bool pairs = false;
#endif
    group_values<C, HEAD_DIM, pairs>(v_cache, table, from, to, group, block_size, kv_heads, g, scores.data(),
                                     partial);
    return;
  }
#endif
  if constexpr (sizeof(C) == 1) {
    eight_bit_values<C, HEAD_DIM>(v_cache, table, g, from, to, group, head_dim, block_size, kv_heads, scores.data(),
                                  values.data(), partial);
    return;
  }
  for (int64_t h = 0; h < group; ++h) {
    const float* p = scores.data() + h * length;
    float acc[HEAD_DIM ? HEAD_DIM : nanovllm::MAX_HEAD_DIM] = {};  // in registers when HEAD_DIM is a constant
    for (int64_t t0 = from - from % block_size; t0 < to; t0 += block_size) {
      const C* block = v_cache + table[t0 / block_size] * block_stride + g * width;
      for (int64_t t = std::max(t0, from); t < std::min(t0 + block_size, to); ++t) {
        const C* v = block + (t - t0) * token_stride;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[t - from] * to_float(v[d]);
      }
    }
    std::copy_n(acc, head_dim, partial + h * (head_dim + 2));
  }
}

// Work items in order: row, then chunk of keys, then KV head (a thread's items read a chunk's blocks for every head in
// turn, while they are in its cache); item_start[row] is the row's first.
struct WorkItems {
  std::vector<int64_t> first, chunks, item_start;
  WorkItems(const int32_t* context_lens, int64_t rows, int64_t kv_heads, int64_t window)
      : first(rows), chunks(rows), item_start(rows + 1, 0) {
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t context = std::max<int64_t>(0, context_lens[row]);
      first[row] = window > 0 ? std::max<int64_t>(0, context - window) : 0;  // first key the query sees
      chunks[row] = (context - first[row] + CHUNK - 1) / CHUNK;
      item_start[row + 1] = item_start[row] + kv_heads * chunks[row];
    }
  }

  // A team thread's contiguous share of the items: where they are few, each item goes to the thread whose part of
  // all the keys holds the item's middle key (a row's last chunk is short: split by count, one thread took the full
  // chunks and the other waited, ~3% of a batch-1 step at 257-511 cached tokens); else an even split by count.
  std::pair<int64_t, int64_t> share(const nanovllm::Team& team, const int32_t* context_lens, int64_t kv_heads) const {
    const int64_t rows = static_cast<int64_t>(first.size()), count = item_start[rows];
    if (count > FEW_ITEMS) return {count * team.id / team.size, count * (team.id + 1) / team.size};
    int64_t total = 0;
    for (int64_t row = 0; row < rows; ++row) total += (std::max<int64_t>(0, context_lens[row]) - first[row]) * kv_heads;
    int64_t begin = count, end = count, before = 0, item = 0;
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t c = 0; c < chunks[row]; ++c) {
        const int64_t keys = std::min<int64_t>(CHUNK, context_lens[row] - first[row] - c * CHUNK);
        for (int64_t g = 0; g < kv_heads; ++g, ++item, before += keys)
          if (std::min<int64_t>(team.size - 1, (2 * before + keys) * team.size / (2 * total)) == team.id)
            begin = std::min(begin, item), end = item + 1;
      }
    return {begin, end};
  }

  static constexpr int64_t FEW_ITEMS = 256;
};

template <typename T, typename C, int64_t HEAD_DIM>
static void decode_rows(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                        const int32_t* context_lens, T* out, int64_t rows, int64_t heads, int64_t kv_heads,
                        int64_t runtime_head_dim, int64_t block_size, int64_t table_width, float scale,
                        int64_t window, float softcap, const nanovllm::Team* team, float* shared_partials) {
  const int64_t head_dim = HEAD_DIM ? HEAD_DIM : runtime_head_dim;  // a constant lets the compiler unroll
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * row_width<C>(head_dim);  // next token in a block
  const int64_t block_stride = block_size * token_stride;
  const int64_t stride = group * (head_dim + 2);      // one work item's partial results
  const WorkItems items(context_lens, rows, kv_heads, window);
  const auto &first = items.first, &chunks = items.chunks, &item_start = items.item_start;
  std::vector<float> own(team ? 0 : item_start[rows] * stride);
  float* partials = team ? shared_partials : own.data();
  const auto run_items = [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), scores(group * CHUNK), floats(std::max(head_dim, CHUNK));
    std::vector<float> values(sizeof(C) == 1 ? VALUE_TILE * head_dim : 0);  // an 8-bit cache's V, as floats
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const int64_t c = (item - item_start[row]) / kv_heads, g = (item - item_start[row]) % kv_heads;
      const int64_t from = first[row] + c * CHUNK, to = std::min<int64_t>(from + CHUNK, context_lens[row]);
      decode_chunk<T, C, HEAD_DIM>(q, k_cache, v_cache, block_tables + row * table_width, row, g, from, to, heads,
                                group, head_dim, block_size, block_stride, token_stride, scale, softcap, query,
                                scores, floats, values, partials + item * stride);
    }
  };
  if (team) {
    const auto [begin, end] = items.share(*team, context_lens, kv_heads);
    if (begin < end) run_items(begin, end);
    team->barrier();
  } else {
    nanovllm::split(nullptr, item_start[rows], 1, run_items);
  }
  // Each head's chunks merged in order, each rescaled to the row's maximum score (a single chunk is left as it is:
  // exp(0) is 1), then normalized.
  nanovllm::split(team, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t row = pair / kv_heads, g = pair % kv_heads;
      if (chunks[row] == 0) continue;
      const float* part = partials + (item_start[row] + g) * stride;  // chunk c's at c * kv_heads * stride
      for (int64_t h = 0; h < group; ++h) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks[row]; ++c)
          top = std::max(top, part[c * kv_heads * stride + h * (head_dim + 2) + head_dim]);
        float acc[HEAD_DIM ? HEAD_DIM : nanovllm::MAX_HEAD_DIM] = {};
        float total = 0.f;
        for (int64_t c = 0; c < chunks[row]; ++c) {
          const float* p = part + c * kv_heads * stride + h * (head_dim + 2);
          const float weight = std::exp(p[head_dim] - top);
          total += weight * p[head_dim + 1];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * p[d];
        }
        T* o = out + (row * heads + g * group + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[d] / total);
      }
    }
  });
}

template <typename T, typename C>
void nanovllm::paged_decode_rows(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                                 const int32_t* context_lens, T* out, int64_t rows, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t table_width, float scale,
                                 int64_t window, float softcap, const Team* team, float* partials) {
  auto run = head_dim == 64 ? decode_rows<T, C, 64> : head_dim == 128 ? decode_rows<T, C, 128> : decode_rows<T, C, 0>;
  run(q, k_cache, v_cache, block_tables, context_lens, out, rows, heads, kv_heads, head_dim, block_size, table_width,
      scale, window, softcap, team, partials);
}

int64_t nanovllm::paged_decode_partials(const int32_t* context_lens, int64_t rows, int64_t heads, int64_t kv_heads,
                                        int64_t head_dim, int64_t window) {
  return WorkItems(context_lens, rows, kv_heads, window).item_start[rows] * (heads / kv_heads) * (head_dim + 2);
}

#define NANOVLLM_PAGED_DECODE(T, C)                                                                                \
  template void nanovllm::paged_decode_rows<T, C>(const T*, const C*, const C*, const int32_t*, const int32_t*, T*, \
                                                  int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,     \
                                                  int64_t, float, const Team*, float*);
#define NANOVLLM_PAGED_DECODE_CACHES(T) \
  NANOVLLM_PAGED_DECODE(T, T)           \
  NANOVLLM_PAGED_DECODE(T, c10::Float8_e4m3fn) NANOVLLM_PAGED_DECODE(T, c10::Float8_e5m2) \
  NANOVLLM_PAGED_DECODE(T, Int8Scaled)
NANOVLLM_PAGED_DECODE_CACHES(float)
NANOVLLM_PAGED_DECODE_CACHES(c10::BFloat16)
NANOVLLM_PAGED_DECODE_CACHES(c10::Half)
#undef NANOVLLM_PAGED_DECODE_CACHES
#undef NANOVLLM_PAGED_DECODE

void nanovllm::check_key_tiles(int64_t element_size, int64_t block_size) {
  TORCH_CHECK(element_size > 1 || block_size % KEY_TILE == 0,
              nanovllm::message("an 8-bit KV cache keeps K in tiles of ", KEY_TILE, " tokens: its blocks must hold a "
                                "multiple of ", KEY_TILE, " tokens, not ", block_size));
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const auto cache = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache && cache_serves(cache, q.scalar_type()),
              "the caches must hold q's dtype, 8-bit floats (float8_e4m3fn, float8_e5m2) or an int8 cache's bytes");
  TORCH_CHECK(k_cache.size(3) == cache_row_width(cache, q.size(2)),
              "the caches' rows must be head_dim wide (an int8 cache's: head_dim + 4, the scale's bytes)");
  TORCH_CHECK(q.size(2) <= nanovllm::MAX_HEAD_DIM, nanovllm::message("head_dim above ", nanovllm::MAX_HEAD_DIM));
  nanovllm::check_key_tiles(k_cache.element_size(), k_cache.size(1));
  q = q.contiguous();
  block_tables = block_tables.to(at::kInt).contiguous();
  context_lens = context_lens.to(at::kInt).contiguous();
  auto out = q.new_zeros(q.sizes());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto zero) {
      using C = decltype(zero);
      nanovllm::paged_decode_rows(q.data_ptr<scalar_t>(), static_cast<const C*>(k_cache.const_data_ptr()),
                                  static_cast<const C*>(v_cache.const_data_ptr()),
                                  block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                                  out.data_ptr<scalar_t>(), q.size(0), q.size(1), k_cache.size(2), q.size(2),
                                  k_cache.size(1), block_tables.size(1), static_cast<float>(scale), window,
                                  static_cast<float>(softcap));
    };
    with_cache_type<scalar_t>(cache, run);
  });
  return out;
}
