// Scalar helpers shared by the CPU kernels, written so the compiler vectorizes loops that call them.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

static inline float to_float(float x) { return x; }
static inline float to_float(c10::Half x) { return static_cast<float>(x); }
static inline float to_float(c10::BFloat16 x) {  // a shift the compiler vectorizes (c10's conversion it does not)
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// An 8-bit KV cache's values, exact, one at a time: the byte's exponent and mantissa placed under a float's, the
// exponent bias made up by one multiplication (a float subnormal times 2^120 is the number it stands for). Runs of them
// go through `to_floats`.
static inline float to_float(c10::Float8_e4m3fn x) {
  const uint32_t bits = (static_cast<uint32_t>(x.x & 0x80u) << 24) | (static_cast<uint32_t>(x.x & 0x7Fu) << 20);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}
static inline float to_float(c10::Float8_e5m2 x) {
  const uint32_t bits = (static_cast<uint32_t>(x.x & 0x80u) << 24) | (static_cast<uint32_t>(x.x & 0x7Fu) << 21);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * 0x1p112f;
}

// kv_cache_dtype="int8": each (token, KV head) row of head_dim values as a sign and a 7-bit magnitude (so that it
// widens by the same byte tables as an 8-bit float), times the row's float32 scale (its largest magnitude / 127),
// which the cache keeps beside it (`SCALE_BYTES` more a row; where: `tile_scale`); a value is magnitude * scale.
struct Int8Scaled {
  uint8_t x;
  struct from_bits_t {};
  static constexpr from_bits_t from_bits() { return {}; }
  Int8Scaled() = default;
  constexpr Int8Scaled(uint8_t bits, from_bits_t) : x(bits) {}
};
static inline float to_float(Int8Scaled v) {  // the magnitude, signed (not yet scaled)
  const float magnitude = static_cast<float>(v.x & 0x7Fu);
  return v.x & 0x80u ? -magnitude : magnitude;
}

// Bytes of a (token, KV head) row's scale after its values: 4 in an int8 cache, none in the others.
template <typename C>
constexpr int64_t SCALE_BYTES = std::is_same_v<C, Int8Scaled> ? 4 : 0;
// A cache row's width in elements of C: head_dim values, then the scale's bytes; `cache_row_width` by dtype.
template <typename C>
constexpr int64_t row_width(int64_t head_dim) {
  return head_dim + SCALE_BYTES<C> / static_cast<int64_t>(sizeof(C));
}
static inline int64_t cache_row_width(c10::ScalarType cache, int64_t head_dim) {
  return cache == c10::ScalarType::Byte ? row_width<Int8Scaled>(head_dim) : head_dim;
}

// out[i] = to_float(in[i]) for n values.
template <typename T>
static inline void to_floats(const T* in, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(in[i]);
}

// 8-bit floats (16 or 8 into registers, or n into memory) as float16 bits (e5m2 is a float16's top byte; e4m3's
// exponent and mantissa sit under a float16's, its bias 8 lower: times 2^8; the byte is put in a lane's top byte and
// shifted right by one, the sign copied, the copy in the exponent's top bit then cleared), converted by the CPU's
// float16 instructions, 16 at a time on AVX-512, 8 on AVX2 with F16C, the rest (and every value elsewhere) by
// `to_float`: the same values on every path, and never a subnormal float operand (`to_float`'s vectorized arithmetic
// multiplies e4m3's subnormals: paged_decode over 4,096 e4m3 tokens took 208 us that way, 127 us this way, 113 us over
// bfloat16).
#if defined(__AVX512F__)
template <typename C>
static inline __m512 fp8_lanes16(const C* in) {  // 16 values
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)));
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 1),
                                          _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
  } else {
    return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
  }
}
#endif
#if defined(__AVX2__) && defined(__F16C__)
template <typename C>
static inline __m256 fp8_lanes8(const C* in) {  // 8 values
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in)));
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    const __m128i half = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(bytes, 8), 1),
                                       _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
    return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
  } else {
    return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
  }
}
#endif
template <typename C>
static inline void fp8_to_floats(const C* in, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, fp8_lanes16(in + i));
#endif
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, fp8_lanes8(in + i));
#endif
  for (; i < n; ++i) out[i] = to_float(in[i]);
}
template <>
inline void to_floats<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* in, float* out, int64_t n) {
  fp8_to_floats(in, out, n);
}
template <>
inline void to_floats<c10::Float8_e5m2>(const c10::Float8_e5m2* in, float* out, int64_t n) {
  fp8_to_floats(in, out, n);
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

// 8-bit K/V as torch converts them, saturated at the format's largest finite value first (torch would make NaN or
// infinity of a value beyond it), as `nanovllm.kernels.attention.kv_quant` stores them.
template <>
inline c10::Float8_e4m3fn from_float<c10::Float8_e4m3fn>(float x) {
  return c10::Float8_e4m3fn(std::min(std::max(x, -448.f), 448.f));
}
template <>
inline c10::Float8_e5m2 from_float<c10::Float8_e5m2>(float x) {
  return c10::Float8_e5m2(std::min(std::max(x, -57344.f), 57344.f));
}

template <typename T>
static inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// n values of a K/V row stored as the cache's type C: T itself (copied), or an 8-bit float.
template <typename T, typename C>
static inline void store_row(const T* x, C* out, int64_t n) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(out, x, n * sizeof(T));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = from_float<C>(to_float(x[i]));
  }
}

// An int8 cache's row of n values: their scale (the largest magnitude / 127, or 0), and each value's magnitude
// |x| / scale rounded to nearest even (at most 127), at out[i * stride] (`_to_int8` in kv_quant.py: the same bytes).
template <typename T>
static inline float store_int8(const T* x, Int8Scaled* out, int64_t n, int64_t stride) {
  float largest = 0.f;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, std::abs(to_float(x[i])));
  const float scale = largest / 127.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]), ratio = scale > 0.f ? std::abs(v) / scale : 0.f;
    const float magnitude = std::nearbyint(ratio < 127.f ? ratio : 127.f);
    out[i * stride].x = static_cast<uint8_t>(static_cast<uint8_t>(magnitude) | (v < 0.f ? 0x80u : 0u));
  }
  return scale;
}

// An 8-bit cache's K as the compiled kernels keep it (in blocks of a multiple of KEY_TILE tokens): a block's tokens in
// tiles of KEY_TILE, and a tile's keys of one KV head as [head_dim][KEY_TILE tokens], so that decode scores 16 keys at
// once, a dimension of all 16 at a time, with no sums across lanes (the scores of keys in rows end in shuffles that
// took ~40% of decode attention over 4,096 8-bit keys). An 8-bit float V stays in rows; an int8 cache's V lies in the
// same tiles as its K, as [KEY_TILE tokens][head_dim] (one head's values and scales together, 64-byte aligned), and
// every tile of either ends in its tokens' 16 scales (floats).
constexpr int64_t KEY_TILE = 16;

// Where value d of key `slot`'s head g lies in a tiled K cache with `kv_heads` heads of rows `width` wide
// (`row_width`).
static inline int64_t tiled_key_offset(int64_t slot, int64_t g, int64_t d, int64_t kv_heads, int64_t width) {
  return ((slot / KEY_TILE * kv_heads + g) * width + d) * KEY_TILE + slot % KEY_TILE;
}

// Where the scale of token j of an int8 tile that starts at `tile` lies: after the tile's head_dim * KEY_TILE values.
template <typename P>
static inline P* tile_scale(P* tile, int64_t head_dim, int64_t j) {
  return tile + KEY_TILE * head_dim + 4 * j;
}

// Where token `slot`'s V row of KV head g starts: a row of the cache, or in an int8 cache row slot % KEY_TILE of its
// tile.
template <typename C>
static inline int64_t value_offset(int64_t slot, int64_t g, int64_t kv_heads, int64_t head_dim) {
  if constexpr (std::is_same_v<C, Int8Scaled>)
    return tiled_key_offset(slot - slot % KEY_TILE, g, 0, kv_heads, row_width<C>(head_dim)) +
           slot % KEY_TILE * head_dim;
  else
    return (slot * kv_heads + g) * head_dim;
}

// The float at `at` (a scale in an int8 cache's bytes).
template <typename P>
static inline float scale_at(const P* at) {
  float scale;
  std::memcpy(&scale, at, sizeof scale);
  return scale;
}

// One KV head's key (head_dim values) into its cache slot: a row of a cache of T itself, tiled in an 8-bit one.
template <typename T, typename C>
static inline void store_key(const T* x, C* cache, int64_t slot, int64_t g, int64_t kv_heads, int64_t head_dim) {
  if constexpr (sizeof(C) == 1) {
    C* key = cache + tiled_key_offset(slot, g, 0, kv_heads, row_width<C>(head_dim));
    if constexpr (std::is_same_v<C, Int8Scaled>) {
      const float scale = store_int8(x, key, head_dim, KEY_TILE);
      std::memcpy(tile_scale(key - slot % KEY_TILE, head_dim, slot % KEY_TILE), &scale, sizeof scale);
    } else {
      for (int64_t d = 0; d < head_dim; ++d) key[d * KEY_TILE] = from_float<C>(to_float(x[d]));
    }
  } else {
    store_row(x, cache + (slot * kv_heads + g) * head_dim, head_dim);
  }
}

// A cached key's head_dim values as floats, from a row or a tile (an int8 key's scaled).
template <typename C>
static inline void key_to_floats(const C* cache, int64_t slot, int64_t g, int64_t kv_heads, int64_t head_dim,
                                 float* out) {
  if constexpr (sizeof(C) == 1) {
    const C* key = cache + tiled_key_offset(slot, g, 0, kv_heads, row_width<C>(head_dim));
    float scale = 1.f;
    if constexpr (std::is_same_v<C, Int8Scaled>)
      scale = scale_at(tile_scale(key - slot % KEY_TILE, head_dim, slot % KEY_TILE));
    for (int64_t d = 0; d < head_dim; ++d) out[d] = to_float(key[d * KEY_TILE]) * scale;
  } else {
    to_floats(cache + (slot * kv_heads + g) * head_dim, out, head_dim);
  }
}

// One KV head's value (head_dim values) into its cache slot: a row, in an int8 cache's tile with its scale.
template <typename T, typename C>
static inline void store_value(const T* x, C* cache, int64_t slot, int64_t g, int64_t kv_heads, int64_t head_dim) {
  C* row = cache + value_offset<C>(slot, g, kv_heads, head_dim);
  if constexpr (std::is_same_v<C, Int8Scaled>) {
    const float scale = store_int8(x, row, head_dim, 1);
    std::memcpy(tile_scale(row - slot % KEY_TILE * head_dim, head_dim, slot % KEY_TILE), &scale, sizeof scale);
  } else {
    store_row(x, row, head_dim);
  }
}

// fn(C{}) with C the KV cache's element type for activations of type T: `cache` is T's own, an 8-bit float, or
// bytes (uint8: an int8 cache's values and scales).
template <typename T, typename F>
static inline void with_cache_type(c10::ScalarType cache, const F& fn) {
  if (cache == c10::ScalarType::Float8_e4m3fn)
    fn(c10::Float8_e4m3fn{});
  else if (cache == c10::ScalarType::Float8_e5m2)
    fn(c10::Float8_e5m2{});
  else if (cache == c10::ScalarType::Byte)
    fn(Int8Scaled{});
  else
    fn(T{});
}

// Whether a cache of `cache` serves activations of `dtype`: their own dtype, an 8-bit float, or an int8 cache's bytes.
static inline bool cache_serves(c10::ScalarType cache, c10::ScalarType dtype) {
  return cache == dtype || cache == c10::ScalarType::Float8_e4m3fn || cache == c10::ScalarType::Float8_e5m2 ||
         cache == c10::ScalarType::Byte;
}

// The cache lines of one head's dim values from `row` asked for ahead of their use: heads of a row (or a cached token)
// lie side by side, and the hardware's prefetchers miss a stream of slices that far apart.
template <int LOCALITY = 3, typename T>
static inline void prefetch_head(const T* row, int64_t dim) {
  for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(T)); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + byte, 0, LOCALITY);
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

// `exp_clamped` of a vector's lanes at once (GCC's vector types F of floats and I of as many int32s), for x <= 0
// (scores less their maximum), rounding to the nearest integer by adding and subtracting 1.5 * 2^23: the same values.
// (GCC vectorizes exp_clamped's loop too, but splits its clamp into masked special cases: twice the instructions.)
template <typename F, typename I>
static inline F exp_lanes(F x) {
  const F low = F{} - 87.f, shifter = F{} + 0x1.8p23f;
  x = x < low ? low : x;
  const F n = (x * 1.44269504088896341f + shifter) - shifter;
  const F r = n * -0.693145751953125f + (n * -1.428606765330187e-06f + x);
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return p * reinterpret_cast<const F&>(bits);
}
