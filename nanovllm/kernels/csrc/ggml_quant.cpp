// Matmuls over weights in GGML's block formats (GGUF tensor types), read byte for byte as the file holds them.
//
// As llama.cpp does, each activation row is first quantized per 32 values to int8 (`XBlock`: scale d, d * the sums
// per 16 values, and integer corrections); a weight block is then unpacked to unsigned bytes u = v + zero with a float
// scale a and offset b per 16 or 32 values (w = a * v + b), and the product is an exact integer dot per 32 (or 16)
// values, scaled in float: sum w * x = a * d * sum(v * q) + b * d * sum(q) (see "the products" for the exact order).
// Three paths, picked by the caller (`isa`): PORTABLE (plain C++), AVX2 (`maddubs`: u8 x s8 pairs into int16) and
// AVX512 (AVX512-VNNI `vpdpbusd`, u8 x s8 quads into int32); the build is -march=native, so a path exists only where
// this CPU runs it. The SIMD paths unpack a tile of 16 (AVX-512) or 8 (AVX2) weight rows once per call into a packed
// buffer with the rows side by side in the vector lanes (`pack`), and run up to 8 activation rows at a time past it
// (`tile_rows`): one instruction multiplies 4 values of every row of the tile, no horizontal sums. A single
// activation row skips the packing where it costs more than it saves (`row_tile`). Weights whose rows fill whole tiles
// come repacked at load in tiles of the same rows, their bytes reordered as the vectors need them (`RepackedLayout`
// and its K-quant kin): no packing per call at all, one row up to 3x faster than `row_tile` (as llama.cpp's CPU
// backend), streamed at the read bandwidth. Threads split the tiles (`at::parallel_for`). Every size of prompt goes
// through these integer products: dequantizing to bf16 for oneDNN was ~3x faster per matmul at 32+ rows before the
// packed tiles, but a path chosen by the number of rows would make a row's result depend on its batch mates.
//
// F32, F16 and BF16 weights take float32 dot products through row tiles of their own (`tiled_matmul`, not oneDNN's:
// one reduction order whatever the number of rows).
//
// A row's result never depends on how many rows share its call, nor on the path: the integer sums are exact, and the
// float operations around them are one fixed sequence per row in every variant; contraction is off so that the
// compiler rounds the scalar parts alike (explicit FMA intrinsics stay FMAs).
#pragma GCC optimize("fp-contract=off")
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "check.h"
#include "cpu_math.h"
#include "cpu_ops.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NV_AVX2 1
#include <immintrin.h>
#endif
#if defined(NV_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define NV_AVX512 1
#endif

namespace {

enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

// The SIMD paths' block decoders and the per-chunk products they call: inlined whole, so that the accumulators stay in
// registers (a K-quant decoder, 8 chunks times the rows, is past GCC's own inlining limits: 3x slower out of line).
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define LAMBDA_INLINE __attribute__((always_inline))

constexpr int64_t supported_isa() {
#if defined(NV_AVX512)
  return AVX512;
#elif defined(NV_AVX2)
  return AVX2;
#else
  return PORTABLE;
#endif
}

constexpr int64_t MIN_TASK = 1 << 15;  // weight bytes x rows below which another thread costs more than it saves

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block (12 bytes for 8 pairs).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The 16 signed 6-bit scales of a Q3_K super-block (12 bytes: low 4 bits, then 2 high bits each).
inline void scales_q3k(const uint8_t* s, int* out) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    out[i] = (low | (high << 4)) - 32;
  }
}

#ifdef NV_AVX2
inline __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
inline __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibbles: the low nibbles, then the high ones.
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), bytes(15));
}

// Byte i is `value` where bit i of x is set, else 0.
inline __m256i bits_to_bytes(uint32_t x, int value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(x)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), bytes(value));
}

// Byte i is `value` where bit `bit` of byte i of v is set, else 0.
inline __m256i bit_to_bytes(__m256i v, int bit, int value) {
  const __m256i mask = bytes(1 << bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask), bytes(value));
}
#endif

// Each type: `decode` (portable) unpacks a block into signed values v with a scale a and offset b per 16 values
// (w = a * v + b); `simd` hands each 32 values to f(chunk, u, a0, a1, b0, b1) as bytes u (unsigned, or signed where
// kSigned) with a scale and offset for each 16 (kGroup16) or for all 32 (a0 = a1, b0 = b1).
struct Q4_0 {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kSigned = false, kGroup16 = false;
  static constexpr int kZero = 8;
  static constexpr bool kOffset = false;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const uint8_t* qs = p + 2;
    for (int j = 0; j < 16; ++j) {
      v[j] = static_cast<int8_t>((qs[j] & 15) - 8);
      v[j + 16] = static_cast<int8_t>((qs[j] >> 4) - 8);
    }
    a[0] = a[1] = half_at(p);
    b[0] = b[1] = 0.f;
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p);
    f(0, nibbles16(p + 2), d, d, 0.f, 0.f);
  }
#endif
};

struct Q4_1 {
  static constexpr int kValues = 32, kBytes = 20;
  static constexpr bool kSigned = false, kGroup16 = false;
  static constexpr int kZero = 0;
  static constexpr bool kOffset = true;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const uint8_t* qs = p + 4;
    for (int j = 0; j < 16; ++j) {
      v[j] = static_cast<int8_t>(qs[j] & 15);
      v[j + 16] = static_cast<int8_t>(qs[j] >> 4);
    }
    a[0] = a[1] = half_at(p);
    b[0] = b[1] = half_at(p + 2);
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p), m = half_at(p + 2);
    f(0, nibbles16(p + 4), d, d, m, m);
  }
#endif
};

struct Q5_0 {
  static constexpr int kValues = 32, kBytes = 22;
  static constexpr bool kSigned = false, kGroup16 = false;
  static constexpr int kZero = 16;
  static constexpr bool kOffset = false;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const uint32_t qh = u32_at(p + 2);
    const uint8_t* qs = p + 6;
    for (int j = 0; j < 16; ++j) {
      v[j] = static_cast<int8_t>(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      v[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
    a[0] = a[1] = half_at(p);
    b[0] = b[1] = 0.f;
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p);
    f(0, _mm256_or_si256(nibbles16(p + 6), bits_to_bytes(u32_at(p + 2), 16)), d, d, 0.f, 0.f);
  }
#endif
};

struct Q5_1 {
  static constexpr int kValues = 32, kBytes = 24;
  static constexpr bool kSigned = false, kGroup16 = false;
  static constexpr int kZero = 0;
  static constexpr bool kOffset = true;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const uint32_t qh = u32_at(p + 4);
    const uint8_t* qs = p + 8;
    for (int j = 0; j < 16; ++j) {
      v[j] = static_cast<int8_t>((qs[j] & 15) | (((qh >> j) & 1) << 4));
      v[j + 16] = static_cast<int8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    a[0] = a[1] = half_at(p);
    b[0] = b[1] = half_at(p + 2);
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p), m = half_at(p + 2);
    f(0, _mm256_or_si256(nibbles16(p + 8), bits_to_bytes(u32_at(p + 4), 16)), d, d, m, m);
  }
#endif
};

struct Q8_0 {
  static constexpr int kValues = 32, kBytes = 34;
  static constexpr bool kSigned = true, kGroup16 = false;
  static constexpr int kZero = 0;
  static constexpr bool kOffset = false;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    std::memcpy(v, p + 2, 32);
    a[0] = a[1] = half_at(p);
    b[0] = b[1] = 0.f;
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p);
    f(0, load32(p + 2), d, d, 0.f, 0.f);
  }
#endif
};

// K-quants: 256-value super-blocks. The value order within each 32 follows ggml's dequantize_row_*.
struct Q2_K {  // scales[16] (4-bit scale | 4-bit min), qs[64] (2 bits), d, dmin
  static constexpr int kValues = 256, kBytes = 84;
  static constexpr bool kSigned = false, kGroup16 = true;
  static constexpr int kZero = 0;
  static constexpr bool kOffset = true;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const float d = half_at(p + 80), dmin = half_at(p + 82);
    for (int c = 0; c < 8; ++c) {
      const uint8_t* q = p + 16 + 32 * (c / 4);
      for (int l = 0; l < 32; ++l) v[32 * c + l] = static_cast<int8_t>((q[l] >> (2 * (c % 4))) & 3);
    }
    for (int g = 0; g < 16; ++g) {
      a[g] = d * (p[g] & 15);
      b[g] = -dmin * (p[g] >> 4);
    }
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p + 80), dmin = half_at(p + 82);
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      const __m256i raw = load32(p + 16 + 32 * n);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int c = 4 * n + j, s0 = p[2 * c], s1 = p[2 * c + 1];
        f(c, _mm256_and_si256(srl16(raw, 2 * j), bytes(3)), d * (s0 & 15), d * (s1 & 15), -dmin * (s0 >> 4),
          -dmin * (s1 >> 4));
      }
    }
  }
#endif
};

struct Q3_K {  // hmask[32] (high bit), qs[64] (low 2 bits), scales[12] (16 x 6 bits), d
  static constexpr int kValues = 256, kBytes = 110;
  static constexpr bool kSigned = false, kGroup16 = true;
  static constexpr int kZero = 4;
  static constexpr bool kOffset = false;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const float d = half_at(p + 108);
    for (int c = 0; c < 8; ++c) {
      const uint8_t* q = p + 32 + 32 * (c / 4);
      for (int l = 0; l < 32; ++l)
        v[32 * c + l] = static_cast<int8_t>(((q[l] >> (2 * (c % 4))) & 3) - ((p[l] >> c) & 1 ? 0 : 4));
    }
    int sc[16];
    scales_q3k(p + 96, sc);
    for (int g = 0; g < 16; ++g) {
      a[g] = d * sc[g];
      b[g] = 0.f;
    }
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p + 108);
    int sc[16];
    scales_q3k(p + 96, sc);
    const __m256i hmask = load32(p);
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      const __m256i raw = load32(p + 32 + 32 * n);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int c = 4 * n + j;
        const __m256i u = _mm256_or_si256(_mm256_and_si256(srl16(raw, 2 * j), bytes(3)), bit_to_bytes(hmask, c, 4));
        const float a0 = d * sc[2 * c], a1 = d * sc[2 * c + 1];
        f(c, u, a0, a1, 0.f, 0.f);
      }
    }
  }
#endif
};

struct Q4_K {  // d, dmin, scales[12] (8 x 6-bit scale and min), qs[128] (4 bits)
  static constexpr int kValues = 256, kBytes = 144;
  static constexpr bool kSigned = false, kGroup16 = false;
  static constexpr int kZero = 0;
  static constexpr bool kOffset = true;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const float d = half_at(p), dmin = half_at(p + 2);
    for (int j = 0; j < 4; ++j) {
      const uint8_t* q = p + 16 + 32 * j;
      for (int l = 0; l < 32; ++l) {
        v[64 * j + l] = static_cast<int8_t>(q[l] & 15);
        v[64 * j + 32 + l] = static_cast<int8_t>(q[l] >> 4);
      }
    }
    for (int c = 0; c < 8; ++c) {
      int sc, m;
      scale_min_k4(c, p + 4, sc, m);
      a[2 * c] = a[2 * c + 1] = d * sc;
      b[2 * c] = b[2 * c + 1] = -dmin * m;
    }
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p), dmin = half_at(p + 2);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load32(p + 16 + 32 * j);
      int sc, m;
      scale_min_k4(2 * j, p + 4, sc, m);
      f(2 * j, _mm256_and_si256(raw, bytes(15)), d * sc, d * sc, -dmin * m, -dmin * m);
      scale_min_k4(2 * j + 1, p + 4, sc, m);
      f(2 * j + 1, _mm256_and_si256(srl16(raw, 4), bytes(15)), d * sc, d * sc, -dmin * m, -dmin * m);
    }
  }
#endif
};

struct Q5_K {  // d, dmin, scales[12], qh[32] (5th bits), qs[128]
  static constexpr int kValues = 256, kBytes = 176;
  static constexpr bool kSigned = false, kGroup16 = false;
  static constexpr int kZero = 0;
  static constexpr bool kOffset = true;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const float d = half_at(p), dmin = half_at(p + 2);
    const uint8_t* qh = p + 16;
    for (int j = 0; j < 4; ++j) {
      const uint8_t* q = p + 48 + 32 * j;
      for (int l = 0; l < 32; ++l) {
        v[64 * j + l] = static_cast<int8_t>((q[l] & 15) | (((qh[l] >> (2 * j)) & 1) << 4));
        v[64 * j + 32 + l] = static_cast<int8_t>((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
      }
    }
    for (int c = 0; c < 8; ++c) {
      int sc, m;
      scale_min_k4(c, p + 4, sc, m);
      a[2 * c] = a[2 * c + 1] = d * sc;
      b[2 * c] = b[2 * c + 1] = -dmin * m;
    }
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p), dmin = half_at(p + 2);
    const __m256i qh = load32(p + 16);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load32(p + 48 + 32 * j);
      int sc, m;
      scale_min_k4(2 * j, p + 4, sc, m);
      f(2 * j, _mm256_or_si256(_mm256_and_si256(raw, bytes(15)), bit_to_bytes(qh, 2 * j, 16)), d * sc, d * sc,
        -dmin * m, -dmin * m);
      scale_min_k4(2 * j + 1, p + 4, sc, m);
      f(2 * j + 1, _mm256_or_si256(_mm256_and_si256(srl16(raw, 4), bytes(15)), bit_to_bytes(qh, 2 * j + 1, 16)),
        d * sc, d * sc, -dmin * m, -dmin * m);
    }
  }
#endif
};

struct Q6_K {  // ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d
  static constexpr int kValues = 256, kBytes = 210;
  static constexpr bool kSigned = false, kGroup16 = true;
  static constexpr int kZero = 32;
  static constexpr bool kOffset = false;
  static void decode(const uint8_t* p, int8_t* v, float* a, float* b) {
    const float d = half_at(p + 208);
    for (int n = 0; n < 2; ++n) {
      const uint8_t *ql = p + 64 * n, *qh = p + 128 + 32 * n;
      int8_t* y = v + 128 * n;
      for (int l = 0; l < 32; ++l) {
        y[l] = static_cast<int8_t>(((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32);
        y[l + 32] = static_cast<int8_t>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    for (int g = 0; g < 16; ++g) {
      a[g] = d * sc[g];
      b[g] = 0.f;
    }
  }
#ifdef NV_AVX2
  template <class F>
  ALWAYS_INLINE static void simd(const uint8_t* p, F&& f) {
    const float d = half_at(p + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const __m256i low = bytes(15), high = bytes(0x30);
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      const __m256i l0 = load32(p + 64 * n), l1 = load32(p + 64 * n + 32), h = load32(p + 128 + 32 * n);
      const __m256i u[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), high)),
          _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(h, 2), high)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(h, high)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                          _mm256_and_si256(_mm256_srli_epi16(h, 2), high))};
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const int c = 4 * n + k;
        const float a0 = d * sc[2 * c], a1 = d * sc[2 * c + 1];
        f(c, u[k], a0, a1, 0.f, 0.f);
      }
    }
  }
#endif
};

// How `repack` lays out a block of the types whose weights are repacked at load (`nanovllm.kernels.ggml.repack`): the
// `units` bytes from byte `start` (the values; a K-quant's whole block but its last 2 bytes) in 4-byte units, unit j of
// every row of the tile side by side, then the rest of the block (its half-float scale and offset, before or after) in
// 2-byte units alike. units == 0: the type is run as the file has it.
struct Repacked {
  int64_t bytes = 0, start = 0, units = 0;
};

template <class T>
constexpr Repacked repacked() {
  if constexpr (std::is_same_v<T, Q4_0>) return {T::kBytes, 2, 16};
  if constexpr (std::is_same_v<T, Q4_1>) return {T::kBytes, 4, 16};
  if constexpr (std::is_same_v<T, Q5_0>) return {T::kBytes, 2, 20};
  if constexpr (std::is_same_v<T, Q5_1>) return {T::kBytes, 4, 20};
  if constexpr (std::is_same_v<T, Q8_0>) return {T::kBytes, 2, 32};
  if constexpr (std::is_same_v<T, Q2_K>) return {T::kBytes, 0, 84};
  if constexpr (std::is_same_v<T, Q3_K>) return {T::kBytes, 0, 108};
  if constexpr (std::is_same_v<T, Q4_K>) return {T::kBytes, 0, 144};
  if constexpr (std::is_same_v<T, Q5_K>) return {T::kBytes, 0, 176};
  if constexpr (std::is_same_v<T, Q6_K>) return {T::kBytes, 0, 208};
  return {};
}

// ---- activations ----

// One activation block: 32 values quantized to int8, with what each weight type's products need of it.
struct alignas(64) XBlock {
  float d;         // q * d ~ x
  float s;         // d * sum(q)
  float ds[2];     // d * sum(q) over each 16 values
  int32_t z32;     // -zero * sum(q): the integer correction for weights stored as u = v + zero (`zero_of`)
  int32_t z16[2];  // the same over each 16 values
  int32_t pad;
  int8_t q[32];
};

// Block i's amax = max |v|, its values v * (127 / amax) rounded to the nearest (even) int8 into b.q, and the sums of
// each 16; AVX2 where the CPU has it: GCC leaves the scalar max unvectorized (without -ffast-math), and every
// projection's input went through it, ~5% of a one-row decode step. The same integers and floats either way. A NaN
// makes amax NaN, hence d, hence the row's products NaN, as a float product's would be.
template <typename T>
void quantize_row(const T* x, XBlock* out, int64_t blocks, int zero) {
  for (int64_t i = 0; i < blocks; ++i) {
    alignas(32) float v[32];
    to_floats(x + 32 * i, v, 32);
    XBlock& b = out[i];
    float amax = 0.f;
    int s0 = 0, s1 = 0;
#ifdef NV_AVX2
    __m256 f[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      f[k] = _mm256_load_ps(v + 8 * k);
      m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), f[k]), m);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(f[k], f[k], _CMP_UNORD_Q));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(f[k], _mm256_set1_ps(id)));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.q),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const auto sum = [](__m256i a) {
      const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
      const __m128i u = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
      return _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 1)));
    };
    s0 = sum(_mm256_add_epi32(q[0], q[1]));
    s1 = sum(_mm256_add_epi32(q[2], q[3]));
#else
    bool nan = false;
    for (int j = 0; j < 32; ++j) {
      amax = std::max(amax, std::fabs(v[j]));
      nan |= std::isnan(v[j]);
    }
    amax = nan ? NAN : amax;
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < 32; ++j) b.q[j] = std::isnan(v[j]) ? 0 : static_cast<int8_t>(std::nearbyint(v[j] * id));
    for (int j = 0; j < 16; ++j) {
      s0 += b.q[j];
      s1 += b.q[j + 16];
    }
#endif
    const float d = amax / 127.f;
    b.d = d;
    b.s = d * static_cast<float>(s0 + s1);
    b.ds[0] = d * static_cast<float>(s0);
    b.ds[1] = d * static_cast<float>(s1);
    b.z32 = -zero * (s0 + s1);
    b.z16[0] = -zero * s0;
    b.z16[1] = -zero * s1;
    b.pad = 0;
  }
}

// ---- the products ----
//
// Every path computes, for activation row m and weight row n, the same float arithmetic: per chunk c of 32 values
// (per half h of 16 for kGroup16 types), in order, with the chunk's exact integer dot product
// isum = sum (u - zero) * q,
//   acc = fma(float(isum), a * x.d, acc)   and, for kOffset types,   off = fma(b, x.s (or x.ds[h]), off);
// the result is acc + off (kOffset) or acc. Integer sums are exact whatever their order, so a path may compute isum
// any way it likes: the float operations, one IEEE rounding each, make the result. Hence a row's result never
// depends on its batch mates, how rows are grouped, or the ISA path (portable, AVX2 and AVX-512 agree bit for bit).

// Portable: one weight row against M activation rows (`stride` blocks apart), each block unpacked once to signed
// values (zero already taken off); acc and off hold M floats each.
template <class T>
void portable_rows(const uint8_t* w, int64_t blocks, const XBlock* x, int64_t stride, int64_t M, float* acc,
                   float* off) {
  constexpr int G = T::kValues / 16, H = T::kGroup16 ? 2 : 1, n = 32 / H;
  int8_t v[T::kValues];
  float a[G], b[G];
  std::fill(acc, acc + M, 0.f);
  std::fill(off, off + M, 0.f);
  for (int64_t i = 0; i < blocks; ++i) {
    T::decode(w + i * T::kBytes, v, a, b);
    for (int64_t m = 0; m < M; ++m)
      for (int c = 0; c < T::kValues / 32; ++c) {
        const XBlock& blk = x[m * stride + i * (T::kValues / 32) + c];
        for (int h = 0; h < H; ++h) {
          int32_t s = 0;
          for (int l = 0; l < n; ++l) s += v[32 * c + n * h + l] * blk.q[n * h + l];
          acc[m] = std::fma(static_cast<float>(s), a[2 * c + h] * blk.d, acc[m]);
          if constexpr (T::kOffset) off[m] = std::fma(b[2 * c + h], H == 2 ? blk.ds[h] : blk.s, off[m]);
        }
      }
  }
  if constexpr (T::kOffset)
    for (int64_t m = 0; m < M; ++m) acc[m] += off[m];
}

// The next tile's weights on their way to the cache while this one computes, a slice of it for each block i of
// `blocks`: a tile reads its rows side by side, too short a stream each for the hardware prefetchers (2x slower on
// weights from memory without).
struct Prefetch {
  const uint8_t* next;
  int64_t slice;  // bytes a block, whole cache lines
  ALWAYS_INLINE void operator()(int64_t i) const {
    if (!next) return;
    for (int64_t b = i * slice; b < (i + 1) * slice; b += 64) __builtin_prefetch(next + b);
  }
};

#ifdef NV_AVX2
// The SIMD paths put L weight rows side by side: a tile of L rows is unpacked once into a packed buffer (`pack`),
// where each 4 values of a chunk are a vector of L 4-byte lanes, one per weight row, followed by the chunk's scales
// (and offsets) as L floats. One multiply-add instruction then takes 4 values of every weight row against the same 4
// activation values (broadcast), and the lanes end up holding whole chunk sums: no horizontal sums, and each packed
// vector serves up to R activation rows from registers.
struct Avx2 {
  static constexpr int L = 8;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F loadf(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static I bcast4(const int8_t* q) { return _mm256_set1_epi32(static_cast<int32_t>(u32_at(reinterpret_cast<const uint8_t*>(q)))); }
  // acc + the sums of 4 products of u (unsigned bytes; signed where `kSigned`) and s (signed bytes), per lane
  template <bool kSigned>
  static I dot(I acc, I u, I s) {
    const I ones = _mm256_set1_epi16(1);
    if constexpr (kSigned)
      return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(s, u)),
                                                     ones));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F zero() { return _mm256_setzero_ps(); }
  static I izero() { return _mm256_setzero_si256(); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F load_halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // the bytes of v shifted right by `shift` bits (left where negative), then masked: (v >> shift) & mask; a | b
  static I shifted_bytes(I v, int shift, int mask) {
    const I s = shift > 0 ? _mm256_srli_epi16(v, shift) : shift < 0 ? _mm256_slli_epi16(v, -shift) : v;
    return _mm256_and_si256(s, bytes(mask));
  }
  static I bytes_or(I a, I b) { return _mm256_or_si256(a, b); }
  // byte k of lane n = 16 where bit 4g + k of lane n of qh is set, else 0 (the 5th bits of values 4g.. 4g + 3 of a
  // Q5_0/Q5_1 block whose 32 are in qh): byte g / 2 of the lane to each of its bytes, each byte's bit picked
  static I fifth_bits(I qh, int g) {
    const I lanes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C);
    const I spread = _mm256_shuffle_epi8(qh, _mm256_add_epi8(lanes, bytes(g / 2)));
    const I bit = _mm256_and_si256(spread, _mm256_set1_epi32(0x08040201 << (4 * (g % 2))));
    return _mm256_slli_epi16(_mm256_min_epu8(bit, bytes(1)), 4);
  }
  static I flip(I v) { return _mm256_xor_si256(v, bytes(0x80)); }
  // lane n = the integer dot product of u[n] (32 bytes of weight row n) and the activation chunk q, for L rows
  template <bool kSigned>
  static I row_sums(const __m256i* u, __m256i q) {
    I p[L];
    for (int n = 0; n < L; ++n) p[n] = dot<kSigned>(_mm256_setzero_si256(), u[n], q);
    return reduce(p);
  }
  // lane n: the 4 bytes at base + index[n]; (v >> shift) & mask, a | (b << shift), byte `byte` of v sign-extended
  static I gather(const uint8_t* base, I index) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), index, 1);
  }
  static I bits(I v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(shift)), _mm256_set1_epi32(mask));
  }
  static I or_shifted(I a, I b, int shift) {
    return _mm256_or_si256(a, _mm256_sllv_epi32(b, _mm256_set1_epi32(shift)));
  }
  static I signed_byte(I v, int byte) {
    return _mm256_srai_epi32(_mm256_sllv_epi32(v, _mm256_set1_epi32(24 - 8 * byte)), 24);
  }
  // lane n: the half floats in bytes 0-1 and 2-3 of lane n of g (a block's scale and offset); of the 4 bytes at
  // base + index[n]
  static void split_halves(I g, F& low, F& high) {
    const auto pack = [](I v) { return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)); };
    low = _mm256_cvtph_ps(pack(_mm256_and_si256(g, _mm256_set1_epi32(0xFFFF))));
    high = _mm256_cvtph_ps(pack(_mm256_srli_epi32(g, 16)));
  }
  static void halves(const uint8_t* base, I index, F& low, F& high) { split_halves(gather(base, index), low, high); }
  // lane n = the sum of the 8 lanes of p[n], for 8 vectors
  static I reduce(const __m256i* p) {
    I t[4], u[2];
    for (int i = 0; i < 4; ++i)
      t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
      u[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31));
  }
  // out[g] = dword g of each of the 8 rows of 32 bytes at `rows` (32 bytes apart)
  static void transpose(const uint8_t* rows, uint8_t* out) {
    I z[8], t[8], s[8];
    for (int i = 0; i < 8; ++i) z[i] = load(rows + 32 * i);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int j = 0; j < 2; ++j) {  // s[4j + e]: element e of each 128-bit lane of rows 4j .. 4j + 3
      s[4 * j] = _mm256_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
      s[4 * j + 1] = _mm256_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
      s[4 * j + 2] = _mm256_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
      s[4 * j + 3] = _mm256_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
    }
    for (int e = 0; e < 4; ++e) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * e), _mm256_permute2x128_si256(s[e], s[4 + e], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (4 + e)),
                          _mm256_permute2x128_si256(s[e], s[4 + e], 0x31));
    }
  }
};

#ifdef NV_AVX512
struct Avx512 {
  static constexpr int L = 16;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static F loadf(const uint8_t* p) { return _mm512_loadu_ps(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static I bcast4(const int8_t* q) { return _mm512_set1_epi32(static_cast<int32_t>(u32_at(reinterpret_cast<const uint8_t*>(q)))); }
  template <bool kSigned>  // signed weights are packed as u = v + 128 (`zero_of`)
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F zero() { return _mm512_setzero_ps(); }
  static I izero() { return _mm512_setzero_si512(); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F load_halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I shifted_bytes(I v, int shift, int mask) {  // as Avx2's
    const I s = shift > 0 ? _mm512_srli_epi16(v, shift) : shift < 0 ? _mm512_slli_epi16(v, -shift) : v;
    return _mm512_and_si512(s, _mm512_set1_epi8(static_cast<char>(mask)));
  }
  static I bytes_or(I a, I b) { return _mm512_or_si512(a, b); }
  static I fifth_bits(I qh, int g) {  // as Avx2's
    const I lanes = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);
    const I spread = _mm512_shuffle_epi8(qh, _mm512_add_epi8(lanes, _mm512_set1_epi8(static_cast<char>(g / 2))));
    const I bit = _mm512_and_si512(spread, _mm512_set1_epi32(0x08040201 << (4 * (g % 2))));
    return _mm512_slli_epi16(_mm512_min_epu8(bit, _mm512_set1_epi8(1)), 4);
  }
  static I flip(I v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
  // As Avx2::row_sums, rows n and n + 8 side by side in one register from the products on.
  template <bool kSigned>  // signed weights come packed as u = v + 128 here too
  static I row_sums(const __m256i* u, __m256i q) {
    const I q2 = _mm512_broadcast_i64x4(q);
    I z[8], t[4], p[2];
    for (int i = 0; i < 8; ++i)
      z[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_inserti64x4(_mm512_castsi256_si512(u[i]), u[i + 8], 1),
                                 q2);
    for (int i = 0; i < 4; ++i)
      t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]), _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
      p[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    // 128-bit lanes of p[0]: rows 0-3 (first and second half of their vectors), rows 8-11 (both halves); p[1]: 4-7, 12-15
    const I s = _mm512_add_epi32(_mm512_shuffle_i32x4(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));  // rows 0-3, 8-11, 4-7, 12-15
    return _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0));
  }
  static I gather(const uint8_t* base, I index) { return _mm512_i32gather_epi32(index, base, 1); }  // as Avx2's
  static I bits(I v, int shift, int mask) {
    return _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(shift)), _mm512_set1_epi32(mask));
  }
  static I or_shifted(I a, I b, int shift) {
    return _mm512_or_si512(a, _mm512_sllv_epi32(b, _mm512_set1_epi32(shift)));
  }
  static I signed_byte(I v, int byte) {
    return _mm512_srai_epi32(_mm512_sllv_epi32(v, _mm512_set1_epi32(24 - 8 * byte)), 24);
  }
  static void split_halves(I g, F& low, F& high) {  // as Avx2's
    low = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    high = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
  }
  static void halves(const uint8_t* base, I index, F& low, F& high) { split_halves(gather(base, index), low, high); }
  static void transpose(const uint8_t* rows, uint8_t* out) {
    I z[8], t[8], s[8];
    for (int i = 0; i < 8; ++i)  // rows i and i + 8 side by side
      z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(Avx2::load(rows + 32 * i)), Avx2::load(rows + 32 * (i + 8)), 1);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int j = 0; j < 2; ++j) {
      s[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
      s[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
      s[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
      s[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
    }
    const I low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int e = 0; e < 4; ++e) {
      _mm512_storeu_si512(out + 64 * e, _mm512_permutex2var_epi64(s[e], low, s[4 + e]));
      _mm512_storeu_si512(out + 64 * (4 + e), _mm512_permutex2var_epi64(s[e], high, s[4 + e]));
    }
  }
};
#endif

// The value stored weights are offset by: u = v + zero. Signed Q8_0 bytes become unsigned for `vpdpbusd` (v + 128);
// AVX2 keeps them signed (`maddubs` would saturate on 255 * 127 * 2).
template <class T, class V>
constexpr int zero_of() {
  if constexpr (T::kSigned) return V::L == 16 ? 128 : 0;
  return T::kZero;
}

// The packed layout of a chunk for L weight rows: 8 vectors of L 4-byte lanes (values 4g .. 4g + 3 of each row),
// then H vectors of L scales, then (kOffset) H vectors of L offsets; H = 2 halves for kGroup16 types, else 1.
template <class T, class V>
struct Packed {
  static constexpr int H = T::kGroup16 ? 2 : 1;
  static constexpr int64_t kBytes = 4 * V::L * (8 + H * (T::kOffset ? 2 : 1));
};

// Whether a type's scales and offsets are read for the L rows by one gather (`V::halves`): the types of one chunk a
// block start it with them as half floats; Q8_0's plain bytes are bound by loads, where the gather's 16 cost more than
// 16 scalar conversions (~15%).
template <class T>
constexpr bool gathered_scales() {
  return T::kValues == 32 && !std::is_same_v<T, Q8_0>;
}

// Whether the SIMD paths decode T's scales for a tile's rows at once (`tile_scales`): Q4_K and Q5_K, whose 32-value
// chunks each take a 6-bit scale and min (`scale_min_k4`) times the block's half-float d and dmin, and Q6_K, whose
// 16-value halves each take an int8 scale times d. One row at a time in scalar code, they took most of a one-row
// product's time.
template <class T>
constexpr bool tile_scaled() {
  return std::is_same_v<T, Q4_K> || std::is_same_v<T, Q5_K> || std::is_same_v<T, Q6_K>;
}

// `scale_min_k4(c)` for the blocks of L rows, from their 12 bytes of scales as 3 vectors of L 4-byte lanes (bytes 0-3,
// 4-7, 8-11): the scale from q0 and q8, or the min from q4 and q8 (`nibble` 4): bytes c and c + 4 of the 12, then the
// high 2 bits of bytes 0-7.
template <class V>
ALWAYS_INLINE typename V::I k4_scale(typename V::I q0, typename V::I q8, int c, int nibble = 0) {
  const int j = 8 * (c % 4);
  return c < 4 ? V::bits(q0, j, 63) : V::or_shifted(V::bits(q8, j + nibble, 15), V::bits(q0, j + 6, 3), 4);
}

// a[c][h] and b[c][h], the scale and offset of half h of chunk c (h = 0 for types scaled per 32 values), of the
// blocks at base + index[n], lane n: the floats T::simd computes for each row.
template <class T, class V>
ALWAYS_INLINE void tile_scales(const uint8_t* base, typename V::I index, typename V::F a[8][2], typename V::F b[8][2]) {
  using I = typename V::I;
  typename V::F d, dmin;
  if constexpr (std::is_same_v<T, Q6_K>) {
    V::halves(base + 206, index, dmin, d);  // d: the block's last 2 bytes (the 2 before are scales)
    I scales[4];
    for (int k = 0; k < 4; ++k) scales[k] = V::gather(base + 192 + 4 * k, index);
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) a[g / 2][g % 2] = V::mul(d, V::cvt(V::signed_byte(scales[g / 4], g % 4)));
  } else {
    V::halves(base, index, d, dmin);
    const typename V::F minus_dmin = V::mul(dmin, V::set1f(-1.f));
    const I q0 = V::gather(base + 4, index), q4 = V::gather(base + 8, index), q8 = V::gather(base + 12, index);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      a[c][0] = V::mul(d, V::cvt(k4_scale<V>(q0, q8, c)));
      b[c][0] = V::mul(minus_dmin, V::cvt(k4_scale<V>(q4, q8, c, 4)));
    }
  }
}

// Row n of the tile (`rows` <= L; lanes past `rows` repeat the last row), and its offset from the first, for the gather.
template <class V>
typename V::I tile_row_pointers(const uint8_t* w, int64_t w_stride, int rows, const uint8_t** row) {
  alignas(64) int32_t offsets[V::L];
  for (int n = 0; n < V::L; ++n) {
    row[n] = w + std::min(n, rows - 1) * w_stride;
    offsets[n] = static_cast<int32_t>(row[n] - w);
  }
  return V::load(reinterpret_cast<const uint8_t*>(offsets));
}

// Unpacks `rows` (<= L) weight rows of `blocks` blocks into `out`; lanes past `rows` repeat the last row.
template <class T, class V>
void pack(const uint8_t* w, int64_t w_stride, int rows, int64_t blocks, uint8_t* out, Prefetch ahead) {
  using P = Packed<T, V>;
  constexpr int C = T::kValues / 32, L = V::L;
  constexpr bool gathered = gathered_scales<T>();
  alignas(64) uint8_t stage[C][L][32];
  const uint8_t* row[L];
  const typename V::I index = tile_row_pointers<V>(w, w_stride, rows, row);
  for (int64_t i = 0; i < blocks; ++i) {
    ahead(i);
    uint8_t* chunk0 = out + i * C * P::kBytes;
    for (int n = 0; n < L; ++n) {
      const uint8_t* block = row[n] + i * T::kBytes;
      T::simd(block, [&](int c, __m256i u, float a0, float a1, float b0, float b1) LAMBDA_INLINE {
        if constexpr (T::kSigned && zero_of<T, V>() == 128) u = _mm256_xor_si256(u, bytes(0x80));
        _mm256_store_si256(reinterpret_cast<__m256i*>(stage[c][n]), u);
        if constexpr (!gathered && !tile_scaled<T>()) {
          float* f = reinterpret_cast<float*>(chunk0 + c * P::kBytes + 32 * L);
          f[n] = a0;
          if constexpr (P::H == 2) f[L + n] = a1;
          if constexpr (T::kOffset) {
            f[P::H * L + n] = b0;
            if constexpr (P::H == 2) f[(P::H + 1) * L + n] = b1;
          }
        }
      });
    }
    if constexpr (gathered) {
      typename V::F a, b;
      V::halves(w + i * T::kBytes, index, a, b);
      float* f = reinterpret_cast<float*>(chunk0 + 32 * L);
      V::storef(f, a);
      if constexpr (T::kOffset) V::storef(f + L, b);
    }
    if constexpr (tile_scaled<T>()) {  // laid out as the lambda above lays them
      typename V::F a[8][2], b[8][2];
      tile_scales<T, V>(w + i * T::kBytes, index, a, b);
      for (int c = 0; c < C; ++c) {
        float* f = reinterpret_cast<float*>(chunk0 + c * P::kBytes + 32 * L);
        for (int h = 0; h < P::H; ++h) {
          V::storef(f + h * L, a[c][h]);
          if constexpr (T::kOffset) V::storef(f + (P::H + h) * L, b[c][h]);
        }
      }
    }
    for (int c = 0; c < C; ++c) V::transpose(&stage[c][0][0], chunk0 + c * P::kBytes);
  }
}

// Where `tile_rows` finds the values of chunk c of a layout's block of kChunks chunks (8 / H vectors of L 4-byte lanes
// per half h: 4 values of each weight row, as unsigned bytes u, or signed ones where `kSigned` on AVX2), its L scales
// and its L offsets; a layout object stands for the block at its address. Packed: the buffer `pack` writes, a chunk a
// block.
template <class T, class V>
struct PackedLayout {
  static constexpr int H = Packed<T, V>::H, G = 8 / H, L = V::L, kChunks = 1;
  static constexpr int64_t kBytes = Packed<T, V>::kBytes;
  const uint8_t* p;
  ALWAYS_INLINE typename V::I values(int, int h, int g) const { return V::load(p + 4 * L * (G * h + g)); }
  ALWAYS_INLINE typename V::F scales(int, int h) const { return V::loadf(p + 32 * L + 4 * L * h); }
  ALWAYS_INLINE typename V::F offsets(int, int h) const { return V::loadf(p + 32 * L + 4 * L * (H + h)); }
};

// Repacked at load (`repacked`), the types of one chunk a block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): a tile of L weight
// rows stores each block as its quantized bytes in 4-byte units, unit j of every row side by side (a vector), then the
// L rows' half scales, then their half offsets: the file's bytes, reordered (`nanovllm.kernels.ggml.repack`). Unit j
// of a 4-bit block's 4 holds values 4j.. 4j + 3 in its low nibbles and 16 + 4j.. in its high ones; a 5-bit block puts
// its 32 5th bits first. Nothing is unpacked per call, and one row reads what many do.
template <class T, class V>
struct RepackedLayout {
  static constexpr int L = V::L, kChunks = 1;
  static constexpr int64_t kBytes = L * T::kBytes, kQuants = repacked<T>().units;
  const uint8_t* p;
  ALWAYS_INLINE typename V::I values(int, int, int g) const {
    constexpr int high = kQuants == 20;  // the 5th bits' unit before the nibbles
    if constexpr (kQuants == 32) {
      const typename V::I units = V::load(p + 4 * L * g);
      return zero_of<T, V>() == 128 ? V::flip(units) : units;
    }
    const typename V::I nibbles = V::shifted_bytes(V::load(p + 4 * L * (high + g % 4)), g < 4 ? 0 : 4, 15);
    return high ? V::bytes_or(nibbles, V::fifth_bits(V::load(p), g)) : nibbles;
  }
  ALWAYS_INLINE typename V::F scales(int, int) const { return V::load_halves(p + kQuants * L); }
  ALWAYS_INLINE typename V::F offsets(int, int) const { return V::load_halves(p + (kQuants + 2) * L); }
};

// Q4_K and Q5_K repacked: a block's 36 (44) 4-byte units side by side for the L rows: d and dmin, the 12 bytes of
// scales and mins, (Q5_K: the 32 of 5th bits, unit 4 + g holding bit c of values 4g.. 4g + 3 of each chunk c,) then
// the 128 of nibbles, where unit 4 (12) + 8p + g holds values 4g.. 4g + 3 of chunk 2p in its low nibbles and of chunk
// 2p + 1 in its high ones. The 6-bit scales are decoded as the block is read: 3 vectors a block for every row.
template <class T, class V>
struct RepackedK {
  using I = typename V::I;
  using F = typename V::F;
  static constexpr int L = V::L, kChunks = 8, kNibbles = std::is_same_v<T, Q5_K> ? 12 : 4;
  static constexpr int64_t kBytes = L * T::kBytes;
  const uint8_t* p;
  F d, minus_dmin;
  I q0, q4, q8;
  ALWAYS_INLINE explicit RepackedK(const uint8_t* block)
      : p(block), q0(V::load(block + 4 * L)), q4(V::load(block + 8 * L)), q8(V::load(block + 12 * L)) {
    F dmin;
    V::split_halves(V::load(block), d, dmin);
    minus_dmin = V::mul(dmin, V::set1f(-1.f));
  }
  ALWAYS_INLINE I values(int c, int, int g) const {
    const I nibbles = V::shifted_bytes(V::load(p + 4 * L * (kNibbles + 8 * (c / 2) + g)), c % 2 ? 4 : 0, 15);
    if constexpr (kNibbles == 4) return nibbles;
    return V::bytes_or(nibbles, V::shifted_bytes(V::load(p + 4 * L * (4 + g)), c - 4, 16));
  }
  ALWAYS_INLINE F scales(int c, int) const { return V::mul(d, V::cvt(k4_scale<V>(q0, q8, c))); }
  ALWAYS_INLINE F offsets(int c, int) const { return V::mul(minus_dmin, V::cvt(k4_scale<V>(q4, q8, c, 4))); }
};

// Q6_K repacked: a block's first 52 4-byte units side by side for the L rows (32 of low nibbles, 16 of high 2 bits, 4
// of int8 scales per 16 values), then the L rows' half d. Value unit g of chunk c = 4n + k (n: which 128 values) is
// the nibbles of unit 16n + 8(k % 2) + g (low ones for k < 2) joined with bits 2k, 2k + 1 of unit 32 + 8n + g.
template <class V>
struct RepackedQ6K {
  using I = typename V::I;
  using F = typename V::F;
  static constexpr int L = V::L, kChunks = 8;
  static constexpr int64_t kBytes = L * Q6_K::kBytes;
  const uint8_t* p;
  F d;
  ALWAYS_INLINE explicit RepackedQ6K(const uint8_t* block) : p(block), d(V::load_halves(block + 208 * L)) {}
  ALWAYS_INLINE I values(int c, int h, int g) const {
    const int n = c / 4, k = c % 4, unit = 4 * h + g;
    const I low = V::load(p + 4 * L * (16 * n + 8 * (k % 2) + unit)), high = V::load(p + 4 * L * (32 + 8 * n + unit));
    return V::bytes_or(V::shifted_bytes(low, k < 2 ? 0 : 4, 15), V::shifted_bytes(high, 2 * k - 4, 0x30));
  }
  ALWAYS_INLINE F scales(int c, int h) const {
    const int group = 2 * c + h;
    return V::mul(d, V::cvt(V::signed_byte(V::load(p + 4 * L * (48 + group / 4)), group % 4)));
  }
  ALWAYS_INLINE F offsets(int, int) const { return V::zero(); }
};

// Q2_K repacked: its 21 4-byte units side by side for the L rows: 4 of scales and mins (a byte for each 16 values: the
// scale in its low nibble), 16 of 2-bit values (unit 4 + 8n + j holds values 4j.. 4j + 3 of chunks 4n.. 4n + 3, 2 bits
// each, low first), then d and dmin.
template <class V>
struct RepackedQ2K {
  using I = typename V::I;
  using F = typename V::F;
  static constexpr int L = V::L, kChunks = 8;
  static constexpr int64_t kBytes = L * Q2_K::kBytes;
  const uint8_t* p;
  F d, minus_dmin;
  ALWAYS_INLINE explicit RepackedQ2K(const uint8_t* block) : p(block) {
    F dmin;
    V::split_halves(V::load(block + 80 * L), d, dmin);
    minus_dmin = V::mul(dmin, V::set1f(-1.f));
  }
  ALWAYS_INLINE I values(int c, int h, int g) const {
    return V::shifted_bytes(V::load(p + 4 * L * (4 + 8 * (c / 4) + 4 * h + g)), 2 * (c % 4), 3);
  }
  ALWAYS_INLINE I scale_byte(int c, int h, int nibble) const {
    const int group = 2 * c + h;
    return V::bits(V::load(p + 4 * L * (group / 4)), 8 * (group % 4) + nibble, 15);
  }
  ALWAYS_INLINE F scales(int c, int h) const { return V::mul(d, V::cvt(scale_byte(c, h, 0))); }
  ALWAYS_INLINE F offsets(int c, int h) const { return V::mul(minus_dmin, V::cvt(scale_byte(c, h, 4))); }
};

// Q3_K repacked: its first 27 4-byte units side by side for the L rows (8 of high bits: unit j holds bit c of values
// 4j.. 4j + 3 of each chunk c; 16 of low 2 bits as Q2_K's; 3 of 6-bit scales, `scales_q3k`), then the L rows' half d.
template <class V>
struct RepackedQ3K {
  using I = typename V::I;
  using F = typename V::F;
  static constexpr int L = V::L, kChunks = 8;
  static constexpr int64_t kBytes = L * Q3_K::kBytes;
  const uint8_t* p;
  F d;
  ALWAYS_INLINE explicit RepackedQ3K(const uint8_t* block) : p(block), d(V::load_halves(block + 108 * L)) {}
  ALWAYS_INLINE I values(int c, int h, int g) const {
    const int unit = 4 * h + g;
    const I low = V::shifted_bytes(V::load(p + 4 * L * (8 + 8 * (c / 4) + unit)), 2 * (c % 4), 3);
    return V::bytes_or(low, V::shifted_bytes(V::load(p + 4 * L * unit), c - 2, 4));
  }
  ALWAYS_INLINE F scales(int c, int h) const {  // scales_q3k(2c + h)
    const int group = 2 * c + h, byte = group % 8;
    const I low = V::bits(V::load(p + 4 * L * (24 + byte / 4)), 8 * (byte % 4) + (group < 8 ? 0 : 4), 15);
    const I high = V::bits(V::load(p + 4 * L * 26), 8 * (group % 4) + 2 * (group / 4), 3);
    return V::mul(d, V::cvt(V::iadd(V::or_shifted(low, high, 4), V::set1(-32))));
  }
  ALWAYS_INLINE F offsets(int, int) const { return V::zero(); }
};

// The layout T's weights are repacked in at load.
template <class T, class V>
using RepackedLayoutOf = std::conditional_t<
    std::is_same_v<T, Q4_K> || std::is_same_v<T, Q5_K>, RepackedK<T, V>,
    std::conditional_t<std::is_same_v<T, Q6_K>, RepackedQ6K<V>,
                       std::conditional_t<std::is_same_v<T, Q3_K>, RepackedQ3K<V>,
                                          std::conditional_t<std::is_same_v<T, Q2_K>, RepackedQ2K<V>,
                                                             RepackedLayout<T, V>>>>>;

// How far ahead of its reading `tile_rows` prefetches repacked weights, which it streams from memory: the hardware's
// prefetchers alone, which stop at each 4 KiB page, left a K-quant's products at 55-60% of the read bandwidth at one
// row and at half the speed of packing the tile at 8 (56 MB of weights, 2 threads; 90% and 2x faster with it). Not
// for one row of the one-chunk types, which the hardware keeps fed: there it cost SmolLM2's one-row step 7%.
constexpr int64_t REPACKED_AHEAD = 4096;

// R activation rows (`stride` blocks apart) against a tile of L weight rows laid out as `Layout`: out[r * L + lane].
template <class T, class V, int R, class Layout = PackedLayout<T, V>>
void tile_rows(const uint8_t* tile, int64_t chunks, const XBlock* x, int64_t stride, float* out) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int H = Packed<T, V>::H, G = 8 / H, L = V::L;
  constexpr int S = R <= 2 ? 2 : 1;  // integer chains per row (latency at few rows; the sums are exact either way)
  constexpr bool prefetches = !std::is_same_v<Layout, PackedLayout<T, V>> && (R > 1 || Layout::kChunks > 1);
  F acc[R], off[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = off[r] = V::zero();
  for (int64_t i = 0; i < chunks / Layout::kChunks; ++i) {
    const uint8_t* p = tile + i * Layout::kBytes;
    if constexpr (prefetches)
      for (int64_t b = 0; b < Layout::kBytes; b += 64) __builtin_prefetch(p + REPACKED_AHEAD + b);
    const Layout block{p};
#pragma GCC unroll 8
    for (int j = 0; j < Layout::kChunks; ++j) {
      const int64_t c = i * Layout::kChunks + j;
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        I isum[S][R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const XBlock& blk = x[r * stride + c];
          isum[0][r] = zero_of<T, V>() ? V::set1(H == 2 ? blk.z16[h] : blk.z32) : V::izero();
          if constexpr (S == 2) isum[1][r] = V::izero();
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const I u = block.values(j, h, g);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            isum[g % S][r] =
                V::template dot<T::kSigned>(isum[g % S][r], u, V::bcast4(x[r * stride + c].q + 4 * (G * h + g)));
        }
        const F a = block.scales(j, h), b = T::kOffset ? block.offsets(j, h) : a;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const XBlock& blk = x[r * stride + c];
          const I sum = S == 2 ? V::iadd(isum[0][r], isum[S - 1][r]) : isum[0][r];
          acc[r] = V::fma(V::cvt(sum), V::mul(a, V::set1f(blk.d)), acc[r]);
          if constexpr (T::kOffset) off[r] = V::fma(b, V::set1f(H == 2 ? blk.ds[h] : blk.s), off[r]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) V::storef(out + r * L, T::kOffset ? V::add(acc[r], off[r]) : acc[r]);
}

// One activation row against L weight rows, straight from the weights (no packing: at one row the packing would cost
// more than the products): each row's chunk dotted with the activation chunk (or with each half of it, for types
// scaled per 16 values), the L partial vectors summed across lanes at once. The same integer sums and float operations
// in the same order, so the same results as `tile_rows`.
template <class T, class V>
void row_tile(const uint8_t* w, int64_t w_stride, int rows, int64_t blocks, const XBlock* x, float* out,
              Prefetch ahead) {
  constexpr int L = V::L, C = T::kValues / 32, H = T::kGroup16 ? 2 : 1;
  constexpr bool gathered = gathered_scales<T>();
  using F = typename V::F;
  using I = typename V::I;
  const uint8_t* row[L];
  const I index = tile_row_pointers<V>(w, w_stride, rows, row);
  const __m256i low_half = _mm256_setr_epi64x(-1, -1, 0, 0);
  F acc = V::zero(), off = V::zero();
  for (int64_t i = 0; i < blocks; ++i) {
    ahead(i);
    __m256i u[C][L];
    alignas(64) float a[C][H][L], b[C][H][L];
#pragma GCC unroll 16
    for (int n = 0; n < L; ++n) {
      T::simd(row[n] + i * T::kBytes, [&](int c, __m256i un, float a0, float a1, float b0, float b1) LAMBDA_INLINE {
        if constexpr (T::kSigned && zero_of<T, V>() == 128) un = _mm256_xor_si256(un, bytes(0x80));
        u[c][n] = un;
        if constexpr (!gathered && !tile_scaled<T>()) {
          a[c][0][n] = a0, b[c][0][n] = b0;
          if constexpr (H == 2) a[c][1][n] = a1, b[c][1][n] = b1;
        }
      });
    }
    F a_gathered, b_gathered, a_tile[8][2], b_tile[8][2];
    if constexpr (gathered) V::halves(w + i * T::kBytes, index, a_gathered, b_gathered);
    if constexpr (tile_scaled<T>()) tile_scales<T, V>(w + i * T::kBytes, index, a_tile, b_tile);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const XBlock& blk = x[i * C + c];
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.q));
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {  // per 16 values: the activation's other half zeroed
        const __m256i qh = H == 1 ? q : _mm256_and_si256(q, h == 0 ? low_half : _mm256_xor_si256(low_half, bytes(-1)));
        const I isum = V::iadd(V::template row_sums<T::kSigned>(u[c], qh), V::set1(H == 2 ? blk.z16[h] : blk.z32));
        const F scale = gathered ? a_gathered
                        : tile_scaled<T>() ? a_tile[c][h] : V::loadf(reinterpret_cast<const uint8_t*>(a[c][h]));
        acc = V::fma(V::cvt(isum), V::mul(scale, V::set1f(blk.d)), acc);
        if constexpr (T::kOffset) {
          const F offset = gathered ? b_gathered
                           : tile_scaled<T>() ? b_tile[c][h] : V::loadf(reinterpret_cast<const uint8_t*>(b[c][h]));
          off = V::fma(offset, V::set1f(H == 2 ? blk.ds[h] : blk.s), off);
        }
      }
    }
  }
  V::storef(out, T::kOffset ? V::add(acc, off) : acc);
}
#endif

// Whether one activation row takes `row_tile` rather than a packed tile: for every type but Q6_K, on both paths
// (measured since the K-quants' scales are decoded a tile at a time, 2 threads, 1024 -> 6144, µs: on AVX2 Q4_K 93
// against 123 packed, Q5_K 122 against 143; on AVX-512 Q6_K 159 against 113 packed).
template <class T>
constexpr bool row_tile_pays() {
  return !std::is_same_v<T, Q6_K>;
}

constexpr int MAX_ROWS = 8;  // activation rows one pass over a packed tile serves (registers: 3 vectors a row)
constexpr int MAX_LANES = 16;

using TileFn = void (*)(const uint8_t* packed, int64_t chunks, const XBlock* x, int64_t stride, float* out);
using PackFn = void (*)(const uint8_t* w, int64_t w_stride, int rows, int64_t blocks, uint8_t* out, Prefetch ahead);
using RowTileFn = void (*)(const uint8_t* w, int64_t w_stride, int rows, int64_t blocks, const XBlock* x, float* out,
                          Prefetch ahead);
using RowFn = void (*)(const uint8_t* w, int64_t blocks, const XBlock* x, int64_t stride, int64_t M, float* acc,
                      float* off);

struct Kernel {
  TileFn tiles[MAX_ROWS] = {};  // tiles[R - 1]: R rows a pass, up to `max_rows` (as many as the ISA's registers hold)
  TileFn repacked[MAX_ROWS] = {};  // the same over tiles repacked at load (`RepackedLayout`), where the type has them
  PackFn pack = nullptr;
  RowTileFn row_tile = nullptr;  // one activation row, unpacked
  RowFn row = nullptr;   // portable
  int lanes = 1, max_rows = 1, zero = 0;
  int64_t values = 0, bytes = 0, packed_chunk = 0;
  Repacked layout;  // how `repack` lays out the type's blocks (whatever the path runs)
};

#ifdef NV_AVX2
// k.tiles[R - 1] (and k.repacked[R - 1], where T is repacked at load) for every R of `rows` + 1.
template <class T, class V, int... rows>
void set_tiles(Kernel& k, std::integer_sequence<int, rows...>) {
  ((k.tiles[rows] = tile_rows<T, V, rows + 1>), ...);
  if constexpr (repacked<T>().units > 0) ((k.repacked[rows] = tile_rows<T, V, rows + 1, RepackedLayoutOf<T, V>>), ...);
}
#endif

template <class T, int ISA>
Kernel kernel_for() {
  Kernel k;
  k.values = T::kValues;
  k.bytes = T::kBytes;
  k.layout = repacked<T>();
#ifdef NV_AVX512
  if constexpr (ISA == AVX512) {
    using V = Avx512;
    set_tiles<T, V>(k, std::make_integer_sequence<int, 8>{});
    if constexpr (row_tile_pays<T>()) k.row_tile = row_tile<T, V>;
    k.pack = pack<T, V>, k.lanes = V::L, k.max_rows = 8, k.zero = zero_of<T, V>(), k.packed_chunk = Packed<T, V>::kBytes;
    return k;
  }
#endif
#ifdef NV_AVX2
  if constexpr (ISA == AVX2) {
    using V = Avx2;
    set_tiles<T, V>(k, std::make_integer_sequence<int, 4>{});
    if constexpr (row_tile_pays<T>()) k.row_tile = row_tile<T, V>;
    k.pack = pack<T, V>, k.lanes = V::L, k.max_rows = 4, k.zero = zero_of<T, V>(), k.packed_chunk = Packed<T, V>::kBytes;
    return k;
  }
#endif
  k.row = portable_rows<T>;
  return k;
}

template <int ISA>
bool kernel_of(int64_t qtype, Kernel& k) {
  switch (qtype) {
    case 2: k = kernel_for<Q4_0, ISA>(); return true;
    case 3: k = kernel_for<Q4_1, ISA>(); return true;
    case 6: k = kernel_for<Q5_0, ISA>(); return true;
    case 7: k = kernel_for<Q5_1, ISA>(); return true;
    case 8: k = kernel_for<Q8_0, ISA>(); return true;
    case 10: k = kernel_for<Q2_K, ISA>(); return true;
    case 11: k = kernel_for<Q3_K, ISA>(); return true;
    case 12: k = kernel_for<Q4_K, ISA>(); return true;
    case 13: k = kernel_for<Q5_K, ISA>(); return true;
    case 14: k = kernel_for<Q6_K, ISA>(); return true;
    default: return false;
  }
}

bool kernel_of(int64_t qtype, int64_t isa, Kernel& k) {
#ifdef NV_AVX512
  if (isa == AVX512) return kernel_of<AVX512>(qtype, k);
#endif
#ifdef NV_AVX2
  if (isa == AVX2) return kernel_of<AVX2>(qtype, k);
#endif
  return kernel_of<PORTABLE>(qtype, k);
}

// Weight rows a thread takes at least: enough work to pay for the thread.
int64_t grain(int64_t row_bytes, int64_t rows) {
  return std::max<int64_t>(MAX_LANES, MIN_TASK / std::max<int64_t>(row_bytes * rows, 1));
}

template <typename T>
void write_out(const float* res, int64_t n, int64_t count, const T* bias, T* out) {  // out: the row's start
  for (int64_t j = 0; j < count; ++j) out[n + j] = from_float<T>(res[j] + (bias ? to_float(bias[n + j]) : 0.f));
}

// out[M, N] (rows `ldo` apart) = x[M] . w[N] + bias. Threads split the weight rows in tiles of L (the ISA's lanes); a
// thread packs each of its tiles once (K / 32 chunks of a few hundred bytes: in L1 or L2 for any layer) and runs every
// activation row past it, as many a pass as are left up to `max_rows` (6 rows as one pass, not 4 + 2: a pass unpacks
// the tile's values once for all its rows); weights repacked at load (`repacked`: their tiles of L rows) are run as
// they lie. A team quantizes the activations into `scratch`, shared, and waits for all of them before the products;
// or, `own_scratch`, each thread quantizes all of them into its own.
template <typename T>
void quantized_matmul(const Kernel& k, const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t w_stride,
                      int64_t N, bool repacked, const T* bias, T* out, int64_t ldo, const nanovllm::Team* team,
                      void* scratch, bool own_scratch) {
  const int64_t xs = K / 32, blocks = K / k.values;
  std::vector<XBlock> own(team ? 0 : M * xs);
  XBlock* xq = team ? static_cast<XBlock*>(scratch) : own.data();
  const nanovllm::Team alone;
  // by blocks, not rows: at one row a team's threads share it (a row each left one thread idle, 4 times a layer)
  nanovllm::split(own_scratch ? &alone : team, M * xs, MIN_TASK / 32, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) quantize_row(x + b / xs * K + b % xs * 32, xq + b, 1, k.zero);
  });
  if (team && !own_scratch) team->barrier();
  if (!k.pack) {
    nanovllm::split(team, N, grain(w_stride, M), [&](int64_t n0, int64_t n1) {
      std::vector<float> res(2 * M);
      for (int64_t n = n0; n < n1; ++n) {
        k.row(w + n * w_stride, blocks, xq, xs, M, res.data(), res.data() + M);
        for (int64_t m = 0; m < M; ++m) write_out(&res[m], n, 1, bias, out + m * ldo);
      }
    });
    return;
  }
  const int64_t L = k.lanes, tiles = (N + L - 1) / L;
  nanovllm::split(team, tiles, (grain(w_stride, M) + L - 1) / L, [&](int64_t t0, int64_t t1) {
    const bool one_row = !repacked && M == 1 && k.row_tile, packs = !repacked && !one_row;
    std::unique_ptr<uint8_t[]> packed(packs ? new uint8_t[xs * k.packed_chunk + 64] : nullptr);  // not zeroed
    uint8_t* buf = packs ? packed.get() + (64 - reinterpret_cast<uintptr_t>(packed.get()) % 64) % 64 : nullptr;
    alignas(64) float res[MAX_ROWS * MAX_LANES];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * L, count = std::min(L, N - n);
      Prefetch ahead{nullptr, 0};  // repacked tiles: `tile_rows` prefetches them
      if (t + 1 < t1 && !repacked) {
        const int64_t bytes = std::min(L, N - n - L) * w_stride;
        ahead = {w + (n + L) * w_stride, ((bytes + blocks - 1) / blocks + 63) / 64 * 64};
      }
      if (one_row) {
        k.row_tile(w + n * w_stride, w_stride, static_cast<int>(count), blocks, xq, res, ahead);
        write_out(res, n, count, bias, out);
        continue;
      }
      if (packs) k.pack(w + n * w_stride, w_stride, static_cast<int>(count), blocks, buf, ahead);
      for (int64_t m = 0, R; m < M; m += R) {
        R = std::min<int64_t>(k.max_rows, M - m);
        if (repacked)
          k.repacked[R - 1](w + n * w_stride, xs, xq + m * xs, xs, res);
        else
          k.tiles[R - 1](buf, xs, xq + m * xs, xs, res);
        for (int64_t r = 0; r < R; ++r) write_out(res + r * L, n, count, bias, out + (m + r) * ldo);
      }
    }
  });
}

// ---- float weights (F32, F16, BF16): dot products in float32 ----

constexpr int ROW_VARIANTS = 3;       // passes of 1, 2 or 4 activation rows (`rows[log2 R]`)
constexpr int FLOAT_ROWS = 4;
constexpr int64_t TILE = 16;          // weight rows reused from cache across the activation rows
constexpr int64_t X_TILE = 32;        // activation rows reused from cache across the weight rows

// out[M, N] (rows `ldo` apart) = x[M] . w[N] + bias: threads over tiles of weight rows; each weight row serves up to
// `per_pass` activation rows (R = 2^level rows: `rows[level]`) per pass, while its tile stays in L1 and a tile of
// X_TILE activation rows in L2. Activation row m starts at x + m * x_stride.
template <typename A, typename T>
void tiled_matmul(void (*const* rows)(const uint8_t*, int64_t, const A*, int64_t, float*), int per_pass,
                  int64_t depth, const A* x, int64_t x_stride, int64_t M, const uint8_t* w, int64_t w_stride,
                  int64_t N, const T* bias, T* out, int64_t ldo, const nanovllm::Team* team = nullptr) {
  nanovllm::split(team, N, grain(w_stride, M), [&](int64_t n0, int64_t n1) {
    float res[FLOAT_ROWS], tile[X_TILE][TILE];  // a tile of results, written out row by row
    for (int64_t m0 = 0; m0 < M; m0 += X_TILE) {
      const int64_t m1 = std::min(m0 + X_TILE, M);
      for (int64_t t0 = n0; t0 < n1; t0 += TILE) {
        const int64_t t1 = std::min(t0 + TILE, n1);
        for (int64_t m = m0, R; m < m1; m += R) {
          int level = 0;  // the most rows a pass takes, at most those left
          while ((2 << level) <= std::min<int64_t>(per_pass, m1 - m)) ++level;
          R = int64_t{1} << level;
          for (int64_t n = t0; n < t1; ++n) {
            rows[level](w + n * w_stride, depth, x + m * x_stride, x_stride, res);
            for (int r = 0; r < R; ++r) tile[m - m0 + r][n - t0] = res[r];
          }
        }
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t n = t0; n < t1; ++n)
            out[m * ldo + n] = from_float<T>(tile[m - m0][n - t0] + (bias ? to_float(bias[n]) : 0.f));
      }
    }
  });
}


using FloatRowsFn = void (*)(const uint8_t* w, int64_t K, const float* x, int64_t stride, float* out);

template <typename W, int R>
void portable_float_rows(const uint8_t* wb, int64_t K, const float* x, int64_t stride, float* out) {
  const W* w = reinterpret_cast<const W*>(wb);
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * stride;
    float acc = 0.f;
    for (int64_t i = 0; i < K; ++i) acc += to_float(w[i]) * xr[i];
    out[r] = acc;
  }
}

#ifdef NV_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename W>
inline __m256 load8(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<W, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

template <typename W, int R>
void simd_float_rows(const uint8_t* wb, int64_t K, const float* x, int64_t stride, float* out) {
  const W* w = reinterpret_cast<const W*>(wb);
  __m256 acc[2][R];
  for (int e = 0; e < 2; ++e)
    for (int r = 0; r < R; ++r) acc[e][r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= K; i += 16) {
    const __m256 w0 = load8(w + i), w1 = load8(w + i + 8);
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * stride + i), acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * stride + i + 8), acc[1][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float total = hsum(_mm256_add_ps(acc[0][r], acc[1][r]));
    for (int64_t j = i; j < K; ++j) total += to_float(w[j]) * x[r * stride + j];
    out[r] = total;
  }
}
#endif

template <typename W>
int float_kernels(int64_t isa, FloatRowsFn* rows) {
#ifdef NV_AVX2
  if (isa != PORTABLE) {
    rows[0] = simd_float_rows<W, 1>;
    rows[1] = simd_float_rows<W, 2>;
    rows[2] = simd_float_rows<W, 4>;
    return 4;
  }
#endif
  rows[0] = portable_float_rows<W, 1>;
  return 1;
}

// The element size of a float GGML type, 0 for the block types.
int64_t float_size(int64_t qtype) { return qtype == 0 ? 4 : qtype == 1 || qtype == 30 ? 2 : 0; }

template <typename T>
void float_matmul(int64_t qtype, int64_t isa, const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t w_stride,
                  int64_t N, const T* bias, T* out, int64_t ldo, const nanovllm::Team* team = nullptr) {
  FloatRowsFn rows[ROW_VARIANTS];
  const int per_pass = qtype == 0   ? float_kernels<float>(isa, rows)
                       : qtype == 1 ? float_kernels<c10::Half>(isa, rows)
                                    : float_kernels<c10::BFloat16>(isa, rows);
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(x[i]);
  tiled_matmul(rows, per_pass, K, xf.data(), K, M, w, w_stride, N, bias, out, ldo, team);
}

}  // namespace

int64_t ggml_isa() { return supported_isa(); }

// The rows of a tile that weights of `qtype` are repacked into at load for path `isa` (`RepackedLayout`), or 0 where
// they are run as the file has them.
int64_t ggml_repack_lanes(int64_t qtype, int64_t isa) {
  Kernel k;
  return isa >= PORTABLE && isa <= supported_isa() && !float_size(qtype) && kernel_of(qtype, isa, k) && k.repacked[0]
             ? k.lanes
             : 0;
}

// x @ W.T + bias for x [..., in_features] (float32, bfloat16 or float16) and W [out_features, row bytes] uint8 of
// GGML type `qtype`, computed on path `isa` (at most ggml_isa()); the result in x's dtype. `lanes`: 0, or the rows of
// the tiles W was repacked into (`ggml_repack_lanes`).
at::Tensor ggml_linear(at::Tensor x, at::Tensor weight, int64_t qtype, int64_t in_features,
                       std::optional<at::Tensor> bias, int64_t isa, int64_t lanes) {
  TORCH_CHECK(isa >= PORTABLE && isa <= supported_isa(),
              nanovllm::message("ggml_linear: path ", isa, " is not built for this CPU"));
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "ggml_linear: x and the weight must be on the CPU");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.stride(1) == 1,
              "ggml_linear: the weight must be a uint8 [out_features, row_bytes] tensor with contiguous rows");
  TORCH_CHECK(x.size(-1) == in_features,
              nanovllm::message("ggml_linear: x has ", x.size(-1), " features, the weight ", in_features));
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ggml_linear: x must be float32, bfloat16 or float16");
  const int64_t N = weight.size(0), K = in_features;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N,
                nanovllm::message("ggml_linear: the bias has ", bias->numel(), " values for ", N, " outputs"));
    b = bias->to(dtype).contiguous();
  }
  TORCH_CHECK(lanes == 0 || (lanes == ggml_repack_lanes(qtype, isa) && N % lanes == 0),
              nanovllm::message("ggml_linear: a weight of GGML type ", qtype, " repacked in tiles of ", lanes,
                                " rows, which path ", isa, " does not run (", N, " rows)"));
  auto out = x2.new_empty({M, N});
  if (const int64_t size = float_size(qtype)) {
    TORCH_CHECK(weight.size(1) == K * size, nanovllm::message("ggml_linear: a row of ", K, " values takes ", K * size,
                                                              " bytes, not ", weight.size(1)));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "ggml_linear_float", [&] {
      float_matmul(qtype, isa, x2.const_data_ptr<scalar_t>(), M, K, weight.const_data_ptr<uint8_t>(),
                   weight.stride(0), N, b ? b->const_data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), N);
    });
    return out.view(out_sizes);
  }
  Kernel k;
  TORCH_CHECK(kernel_of(qtype, isa, k), nanovllm::message("ggml_linear: GGML type ", qtype, " is not supported"));
  TORCH_CHECK(K % k.values == 0 && weight.size(1) == K / k.values * k.bytes,
              nanovllm::message("ggml_linear: a row of ", K, " values of GGML type ", qtype, " takes ",
                                K / k.values * k.bytes, " bytes (whole blocks of ", k.values, "), not ", weight.size(1)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "ggml_linear", [&] {
    quantized_matmul(k, x2.const_data_ptr<scalar_t>(), M, K, weight.const_data_ptr<uint8_t>(), weight.stride(0), N,
                     lanes > 0, b ? b->const_data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), N, nullptr,
                     nullptr, false);
  });
  return out.view(out_sizes);
}

template <typename T>
void nanovllm::ggml_matmul(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t w_stride, int64_t N,
                           int64_t qtype, int64_t isa, int64_t lanes, const T* bias, T* out, int64_t ldo,
                           const Team& team, void* scratch, bool own_scratch) {
  if (float_size(qtype)) return float_matmul(qtype, isa, x, M, K, w, w_stride, N, bias, out, ldo, &team);
  Kernel k;
  kernel_of(qtype, isa, k);  // the caller checked it with ggml_supported
  quantized_matmul(k, x, M, K, w, w_stride, N, lanes > 0, bias, out, ldo, &team, scratch, own_scratch);
}

int64_t nanovllm::ggml_scratch_bytes(int64_t M, int64_t K) { return M * (K / 32) * sizeof(XBlock); }

bool nanovllm::ggml_supported(int64_t qtype, int64_t isa, int64_t lanes, int64_t rows) {
  Kernel k;
  const bool runs = isa >= PORTABLE && isa <= supported_isa() && (float_size(qtype) || kernel_of(qtype, isa, k));
  return runs && (lanes == 0 || (lanes == ggml_repack_lanes(qtype, isa) && rows % lanes == 0));
}

#define NANOVLLM_GGML_MATMUL(T)                                                                                  \
  template void nanovllm::ggml_matmul<T>(const T*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, \
                                         int64_t, int64_t, const T*, T*, int64_t, const Team&, void*, bool);
NANOVLLM_GGML_MATMUL(float)
NANOVLLM_GGML_MATMUL(c10::BFloat16)
NANOVLLM_GGML_MATMUL(c10::Half)
#undef NANOVLLM_GGML_MATMUL

namespace {

// Row `row` of K values as gguf-py's numpy dequantizer computes it: a * v, plus the offset b for the types that have
// one (kOffset: adding a zero offset would turn -0 into +0), in float32, then rounded to T.
template <class Q, typename T>
void dequantize_row(const uint8_t* row, int64_t K, T* out) {
  int8_t v[Q::kValues];
  float a[Q::kValues / 16], b[Q::kValues / 16];
  for (int64_t i = 0; i < K / Q::kValues; ++i) {
    Q::decode(row + i * Q::kBytes, v, a, b);
    for (int j = 0; j < Q::kValues; ++j) {
      const float w = a[j / 16] * static_cast<float>(v[j]);
      out[i * Q::kValues + j] = from_float<T>(Q::kOffset ? w + b[j / 16] : w);
    }
  }
}

template <typename W, typename T>
void convert_row(const uint8_t* row, int64_t K, T* out) {
  const W* w = reinterpret_cast<const W*>(row);
  for (int64_t i = 0; i < K; ++i) out[i] = from_float<T>(to_float(w[i]));
}

// Row `id` of a weight of GGML type `qtype` repacked in tiles of `lanes` rows (`RepackedLayout`), in the file's order,
// into `row`.
void file_row(const uint8_t* w, int64_t w_stride, int64_t id, int64_t qtype, int64_t lanes, uint8_t* row) {
  Kernel k;
  kernel_of(qtype, PORTABLE, k);  // the caller checked the type is repacked
  const Repacked r = k.layout;
  const int64_t lane = id % lanes;
  const uint8_t* tile = w + (id - lane) * w_stride;
  for (int64_t b = 0; b < w_stride / r.bytes; ++b) {
    const uint8_t* in = tile + b * lanes * r.bytes;
    uint8_t* block = row + b * r.bytes;
    for (int64_t u = 0; u < r.units / 4; ++u) std::memcpy(block + r.start + 4 * u, in + 4 * (u * lanes + lane), 4);
    const uint8_t* rest = in + r.units * lanes;
    for (int64_t byte = 0, j = 0; byte < r.bytes; byte += 2)
      if (byte < r.start || byte >= r.start + r.units) std::memcpy(block + byte, rest + 2 * (j++ * lanes + lane), 2);
  }
}

template <typename T>
void dequantize_rows(const uint8_t* w, int64_t w_stride, const int64_t* ids, int64_t n, int64_t K, int64_t qtype,
                     int64_t lanes, T* out) {
  std::vector<uint8_t> unpacked(lanes ? w_stride : 0);
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = w + ids[r] * w_stride;
    if (lanes) {
      file_row(w, w_stride, ids[r], qtype, lanes, unpacked.data());
      row = unpacked.data();
    }
    T* o = out + r * K;
    switch (qtype) {
      case 0: convert_row<float>(row, K, o); break;
      case 1: convert_row<c10::Half>(row, K, o); break;
      case 30: convert_row<c10::BFloat16>(row, K, o); break;
      case 2: dequantize_row<Q4_0>(row, K, o); break;
      case 3: dequantize_row<Q4_1>(row, K, o); break;
      case 6: dequantize_row<Q5_0>(row, K, o); break;
      case 7: dequantize_row<Q5_1>(row, K, o); break;
      case 8: dequantize_row<Q8_0>(row, K, o); break;
      case 10: dequantize_row<Q2_K>(row, K, o); break;
      case 11: dequantize_row<Q3_K>(row, K, o); break;
      case 12: dequantize_row<Q4_K>(row, K, o); break;
      case 13: dequantize_row<Q5_K>(row, K, o); break;
      case 14: dequantize_row<Q6_K>(row, K, o); break;
      default: TORCH_CHECK(false, nanovllm::message("ggml_embedding: GGML type ", qtype, " is not supported"));
    }
  }
}

}  // namespace

// Rows `ids` of the weight [rows, row bytes] of GGML type `qtype` (an embedding lookup; `lanes`: 0, or the rows of the
// tiles it was repacked into), dequantized to `dtype`: gguf-py's numpy dequantizer's values, rounded to `dtype`.
at::Tensor ggml_embedding(at::Tensor weight, at::Tensor ids, int64_t qtype, int64_t in_features, at::ScalarType dtype,
                          int64_t lanes) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.stride(1) == 1, "ggml_embedding: the weight must be a uint8 [rows, row_bytes] CPU tensor");
  auto flat = ids.to(at::kLong).contiguous().view({-1});
  const int64_t n = flat.numel(), rows = weight.size(0);
  Kernel k;
  TORCH_CHECK(lanes == 0 || (kernel_of(qtype, PORTABLE, k) && k.layout.units > 0 && rows % lanes == 0),
              nanovllm::message("ggml_embedding: GGML type ", qtype, " (", rows, " rows) is not repacked in tiles of ",
                                lanes, " rows"));
  const int64_t* id = flat.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < rows,
                nanovllm::message("ggml_embedding: id ", id[r], " is outside the ", rows, " rows"));
  auto sizes = ids.sizes().vec();
  sizes.push_back(in_features);
  auto out = weight.new_empty(sizes, weight.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "ggml_embedding", [&] {
    dequantize_rows(weight.const_data_ptr<uint8_t>(), weight.stride(0), id, n, in_features, qtype, lanes,
                    out.data_ptr<scalar_t>());
  });
  return out;
}
