// Matmuls over weights in GGML's block formats (GGUF tensor types), read byte for byte as the file holds them.
//
// As llama.cpp does, each activation row is first quantized per 32 values to int8 (`XBlock`: scale d, d * the sums
// per 16 values); a weight block is then unpacked to unsigned bytes u with a float scale a and offset b per 16 or 32
// values (w = a * u + b; Q8_0 keeps signed bytes), and the product is an integer dot per 32 values:
//   sum w * x = d * (a * sum(u * q) + b * sum(q)).
// Three paths, picked by the caller (`isa`): PORTABLE (plain C++, every type unpacked to int8 then dotted), AVX2
// (`maddubs`: u8 x s8 pairs into int16) and AVX512 (AVX512-VNNI `vpdpbusd`, u8 x s8 quads into int32). The AVX2 and
// AVX512 paths share the unpacking of each type; the build is -march=native, so a path exists only where this CPU
// runs it. Threads split the output rows (`at::parallel_for`); an output tile reuses each unpacked weight block for
// up to `MAX_ROWS` activation rows. Every size of prompt goes through these integer products: dequantizing to bf16
// for oneDNN measured ~3x faster per matmul at 32+ rows, but a path chosen by the number of rows would make a row's
// result depend on its batch mates.
//
// F32, F16 and BF16 weights take float32 dot products through the same row tiles (their own kernels, not oneDNN's:
// one reduction order whatever the number of rows).
//
// A row's result never depends on how many rows share its call: each row's arithmetic is the same sequence in every
// row-tile instantiation, and contraction is off so that the compiler rounds the scalar parts alike in each
// (explicit FMA intrinsics stay FMAs).
#pragma GCC optimize("fp-contract=off")
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <type_traits>
#include <vector>

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

constexpr int MAX_ROWS = 8;          // activation rows one pass over a weight row serves: 8 with AVX-512's 32
                                     // vector registers, 4 with AVX2, 1 portable (`rows_per_pass`); passes take
                                     // 1, 2, 4 or 8 rows (`RowsFn rows[log2 R]`: fewer variants to compile)
constexpr int ROW_VARIANTS = 4;
constexpr int64_t TILE = 16;         // weight rows reused from cache across the activation rows
constexpr int64_t X_TILE = 32;       // activation rows reused from cache across the weight rows
constexpr int64_t MIN_TASK = 1 << 15;  // weight bytes x rows below which another thread costs more than it saves

struct XBlock {
  float d;      // q * d ~ x
  float s;      // d * sum(q)
  float ds[2];  // d * sum(q) over each 16 values
  int8_t q[32];
};

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
    f(0, nibbles16(p + 2), d, d, -8.f * d, -8.f * d);
  }
#endif
};

struct Q4_1 {
  static constexpr int kValues = 32, kBytes = 20;
  static constexpr bool kSigned = false, kGroup16 = false;
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
    f(0, _mm256_or_si256(nibbles16(p + 6), bits_to_bytes(u32_at(p + 2), 16)), d, d, -16.f * d, -16.f * d);
  }
#endif
};

struct Q5_1 {
  static constexpr int kValues = 32, kBytes = 24;
  static constexpr bool kSigned = false, kGroup16 = false;
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
        f(c, u, a0, a1, -4.f * a0, -4.f * a1);
      }
    }
  }
#endif
};

struct Q4_K {  // d, dmin, scales[12] (8 x 6-bit scale and min), qs[128] (4 bits)
  static constexpr int kValues = 256, kBytes = 144;
  static constexpr bool kSigned = false, kGroup16 = false;
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
        f(c, u[k], a0, a1, -32.f * a0, -32.f * a1);
      }
    }
  }
#endif
};

// ---- activations ----

template <typename T>
void quantize_row(const T* x, XBlock* out, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i) {
    float v[32], amax = 0.f;
    for (int j = 0; j < 32; ++j) {
      v[j] = to_float(x[32 * i + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int s0 = 0, s1 = 0;
    XBlock& b = out[i];
    for (int j = 0; j < 32; ++j) b.q[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
    for (int j = 0; j < 16; ++j) {
      s0 += b.q[j];
      s1 += b.q[j + 16];
    }
    b.d = d;
    b.s = d * static_cast<float>(s0 + s1);
    b.ds[0] = d * static_cast<float>(s0);
    b.ds[1] = d * static_cast<float>(s1);
  }
}

// ---- dot products of one weight row with R activation rows (x rows `stride` blocks apart) ----

using RowsFn = void (*)(const uint8_t* w, int64_t blocks, const XBlock* x, int64_t stride, float* out);

template <class T, int R>
void portable_rows(const uint8_t* w, int64_t blocks, const XBlock* x, int64_t stride, float* out) {
  constexpr int G = T::kValues / 16;
  int8_t v[T::kValues];
  float a[G], b[G], acc[R] = {};
  for (int64_t i = 0; i < blocks; ++i) {
    T::decode(w + i * T::kBytes, v, a, b);
    for (int r = 0; r < R; ++r) {
      const XBlock* xb = x + r * stride + i * (T::kValues / 32);
      for (int g = 0; g < G; ++g) {
        const XBlock& blk = xb[g / 2];
        const int h = g % 2;
        int32_t s = 0;
        for (int l = 0; l < 16; ++l) s += v[16 * g + l] * blk.q[16 * h + l];
        acc[r] += a[g] * blk.d * static_cast<float>(s) + b[g] * blk.ds[h];
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#ifdef NV_AVX2
// Sums of 4 adjacent products of unsigned u and signed s bytes, as 8 int32.
template <int ISA>
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef NV_AVX512
  if constexpr (ISA == AVX512) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R>
struct Sums {
  __m256 v[R];   // sum of the scaled integer products
  float o[R];    // sum of the offsets' terms (scale and offset per 32 values)
  __m128 o2[R];  // sums of the offsets' terms of each 16 (scales and offsets per 16 values)
};

template <class T, int ISA, int R>
void simd_rows(const uint8_t* w, int64_t blocks, const XBlock* x, int64_t stride, float* out) {
  // Even chunks of block i add to `first`, odd ones to `second`: two independent chains of FMAs.
  auto block = [&](int64_t i, Sums<R>& first, Sums<R>& second) LAMBDA_INLINE {
    const XBlock* xi = x + i * (T::kValues / 32);
    T::simd(w + i * T::kBytes, [&](int c, __m256i u, float a0, float a1, float b0, float b1) LAMBDA_INLINE {
      [[maybe_unused]] const __m256 scales = _mm256_set_m128(_mm_set1_ps(a1), _mm_set1_ps(a0));
      [[maybe_unused]] const __m128 offsets = _mm_setr_ps(b0, b1, 0.f, 0.f);
      Sums<R>& a = c % 2 ? second : first;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const XBlock& blk = xi[r * stride + c];
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.q));
        __m256i p;
        if constexpr (T::kSigned) {
          p = dot_u8s8<ISA>(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u));
        } else {
          p = dot_u8s8<ISA>(u, q);
        }
        __m256 scale;
        if constexpr (T::kGroup16) {
          scale = _mm256_mul_ps(scales, _mm256_broadcast_ss(&blk.d));
          const __m128 ds = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(blk.ds)));
          a.o2[r] = _mm_fmadd_ps(offsets, ds, a.o2[r]);
        } else {
          scale = _mm256_set1_ps(a0 * blk.d);
          if constexpr (!T::kSigned) a.o[r] += b0 * blk.s;
        }
        a.v[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, a.v[r]);
      }
    });
  };
  Sums<R> even, odd;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    even.v[r] = odd.v[r] = _mm256_setzero_ps();
    even.o[r] = odd.o[r] = 0.f;
    even.o2[r] = odd.o2[r] = _mm_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 2 <= blocks; i += 2) {
    block(i, even, odd);
    block(i + 1, odd, even);
  }
  if (i < blocks) block(i, even, odd);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m128 o2 = _mm_add_ps(even.o2[r], odd.o2[r]);
    out[r] = hsum(_mm256_add_ps(even.v[r], odd.v[r])) + even.o[r] + odd.o[r] + _mm_cvtss_f32(_mm_add_ss(o2,
                                                                                                      _mm_movehdup_ps(o2)));
  }
}
#endif

struct Kernel {
  RowsFn rows[ROW_VARIANTS];
  int rows_per_pass;
  int64_t values, bytes;
};

template <class T, int ISA>
Kernel kernel_for() {
#ifdef NV_AVX2
  if constexpr (ISA == AVX512)
    return {{simd_rows<T, ISA, 1>, simd_rows<T, ISA, 2>, simd_rows<T, ISA, 4>, simd_rows<T, ISA, 8>}, 8, T::kValues,
            T::kBytes};
  if constexpr (ISA == AVX2)
    return {{simd_rows<T, ISA, 1>, simd_rows<T, ISA, 2>, simd_rows<T, ISA, 4>}, 4, T::kValues, T::kBytes};
#endif
  return {{portable_rows<T, 1>}, 1, T::kValues, T::kBytes};
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

int64_t grain(int64_t row_bytes, int64_t rows) {
  return std::max<int64_t>(TILE, MIN_TASK / std::max<int64_t>(row_bytes * rows, 1));
}

// out[M, N] = x[M] . w[N] + bias: threads over tiles of weight rows; each weight row serves up to `per_pass` activation
// rows (R = 2^level rows: `rows[level]`) per pass, while its tile stays in L1 and a tile of X_TILE activation rows in
// L2. Activation row m starts at x + m * x_stride.
template <typename A, typename T>
void tiled_matmul(void (*const* rows)(const uint8_t*, int64_t, const A*, int64_t, float*), int per_pass,
                  int64_t depth,
                  const A* x, int64_t x_stride, int64_t M, const uint8_t* w, int64_t w_stride, int64_t N,
                  const T* bias, T* out) {
  at::parallel_for(0, N, grain(w_stride, M), [&](int64_t n0, int64_t n1) {
    float res[MAX_ROWS], tile[X_TILE][TILE];  // a tile of results, written out row by row
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
            out[m * N + n] = from_float<T>(tile[m - m0][n - t0] + (bias ? to_float(bias[n]) : 0.f));
      }
    }
  });
}

template <typename T>
void quantized_matmul(const Kernel& k, const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t w_stride,
                      int64_t N, const T* bias, T* out) {
  const int64_t xs = K / 32;
  std::vector<XBlock> xq(M * xs);
  at::parallel_for(0, M, std::max<int64_t>(1, MIN_TASK / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(x + m * K, xq.data() + m * xs, xs);
  });
  tiled_matmul(k.rows, k.rows_per_pass, K / k.values, xq.data(), xs, M, w, w_stride, N, bias, out);
}

// ---- float weights (F32, F16, BF16): dot products in float32 ----

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
                  int64_t N, const T* bias, T* out) {
  FloatRowsFn rows[ROW_VARIANTS];
  const int per_pass = qtype == 0   ? float_kernels<float>(isa, rows)
                       : qtype == 1 ? float_kernels<c10::Half>(isa, rows)
                                    : float_kernels<c10::BFloat16>(isa, rows);
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(x[i]);
  tiled_matmul(rows, per_pass, K, xf.data(), K, M, w, w_stride, N, bias, out);
}

}  // namespace

int64_t ggml_isa() { return supported_isa(); }

// x @ W.T + bias for x [..., in_features] (float32, bfloat16 or float16) and W [out_features, row bytes] uint8 of
// GGML type `qtype`, computed on path `isa` (at most ggml_isa()); the result in x's dtype.
at::Tensor ggml_linear(at::Tensor x, at::Tensor weight, int64_t qtype, int64_t in_features,
                       std::optional<at::Tensor> bias, int64_t isa) {
  TORCH_CHECK(isa >= PORTABLE && isa <= supported_isa(), "ggml_linear: path ", isa, " is not built for this CPU");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "ggml_linear: x and the weight must be on the CPU");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.stride(1) == 1,
              "ggml_linear: the weight must be a uint8 [out_features, row_bytes] tensor with contiguous rows");
  TORCH_CHECK(x.size(-1) == in_features, "ggml_linear: x has ", x.size(-1), " features, the weight ", in_features);
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
    TORCH_CHECK(bias->numel() == N, "ggml_linear: the bias has ", bias->numel(), " values for ", N, " outputs");
    b = bias->to(dtype).contiguous();
  }
  auto out = x2.new_empty({M, N});
  if (const int64_t size = float_size(qtype)) {
    TORCH_CHECK(weight.size(1) == K * size, "ggml_linear: a row of ", K, " values takes ", K * size, " bytes, not ",
                weight.size(1));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "ggml_linear_float", [&] {
      float_matmul(qtype, isa, x2.const_data_ptr<scalar_t>(), M, K, weight.const_data_ptr<uint8_t>(),
                   weight.stride(0), N, b ? b->const_data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>());
    });
    return out.view(out_sizes);
  }
  Kernel k;
  TORCH_CHECK(kernel_of(qtype, isa, k), "ggml_linear: GGML type ", qtype, " is not supported");
  TORCH_CHECK(K % k.values == 0 && weight.size(1) == K / k.values * k.bytes, "ggml_linear: a row of ", K,
              " values of GGML type ", qtype, " takes ", K / k.values * k.bytes, " bytes (whole blocks of ",
              k.values, "), not ", weight.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "ggml_linear", [&] {
    quantized_matmul(k, x2.const_data_ptr<scalar_t>(), M, K, weight.const_data_ptr<uint8_t>(), weight.stride(0), N,
                     b ? b->const_data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>());
  });
  return out.view(out_sizes);
}

template <typename T>
void nanovllm::ggml_matmul(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t w_stride, int64_t N,
                           int64_t qtype, int64_t isa, const T* bias, T* out) {
  if (float_size(qtype)) return float_matmul(qtype, isa, x, M, K, w, w_stride, N, bias, out);
  Kernel k;
  TORCH_CHECK(kernel_of(qtype, isa, k), "ggml_matmul: GGML type ", qtype, " is not supported");
  quantized_matmul(k, x, M, K, w, w_stride, N, bias, out);
}

template void nanovllm::ggml_matmul<float>(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                                           int64_t, const float*, float*);
template void nanovllm::ggml_matmul<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, int64_t,
                                                   int64_t, int64_t, int64_t, const c10::BFloat16*, c10::BFloat16*);
template void nanovllm::ggml_matmul<c10::Half>(const c10::Half*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                               int64_t, int64_t, const c10::Half*, c10::Half*);

namespace {

// Row `row` of K values as gguf-py's numpy dequantizer computes it: a * v, plus the offset b for the types that have
// one (`offset`), in float32, then rounded to T.
template <class Q, typename T>
void dequantize_row(const uint8_t* row, int64_t K, bool offset, T* out) {
  int8_t v[Q::kValues];
  float a[Q::kValues / 16], b[Q::kValues / 16];
  for (int64_t i = 0; i < K / Q::kValues; ++i) {
    Q::decode(row + i * Q::kBytes, v, a, b);
    for (int j = 0; j < Q::kValues; ++j) {
      const float w = a[j / 16] * static_cast<float>(v[j]);
      out[i * Q::kValues + j] = from_float<T>(offset ? w + b[j / 16] : w);
    }
  }
}

template <typename W, typename T>
void convert_row(const uint8_t* row, int64_t K, T* out) {
  const W* w = reinterpret_cast<const W*>(row);
  for (int64_t i = 0; i < K; ++i) out[i] = from_float<T>(to_float(w[i]));
}

template <typename T>
void dequantize_rows(const uint8_t* w, int64_t w_stride, const int64_t* ids, int64_t n, int64_t K, int64_t qtype,
                     T* out) {
  const bool offset = qtype == 3 || qtype == 7 || qtype == 10 || qtype == 12 || qtype == 13;  // Q4_1/5_1, Q2/4/5_K
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = w + ids[r] * w_stride;
    T* o = out + r * K;
    switch (qtype) {
      case 0: convert_row<float>(row, K, o); break;
      case 1: convert_row<c10::Half>(row, K, o); break;
      case 30: convert_row<c10::BFloat16>(row, K, o); break;
      case 2: dequantize_row<Q4_0>(row, K, offset, o); break;
      case 3: dequantize_row<Q4_1>(row, K, offset, o); break;
      case 6: dequantize_row<Q5_0>(row, K, offset, o); break;
      case 7: dequantize_row<Q5_1>(row, K, offset, o); break;
      case 8: dequantize_row<Q8_0>(row, K, offset, o); break;
      case 10: dequantize_row<Q2_K>(row, K, offset, o); break;
      case 11: dequantize_row<Q3_K>(row, K, offset, o); break;
      case 12: dequantize_row<Q4_K>(row, K, offset, o); break;
      case 13: dequantize_row<Q5_K>(row, K, offset, o); break;
      case 14: dequantize_row<Q6_K>(row, K, offset, o); break;
      default: TORCH_CHECK(false, "ggml_embedding: GGML type ", qtype, " is not supported");
    }
  }
}

}  // namespace

// Rows `ids` of the weight [rows, row bytes] of GGML type `qtype` (an embedding lookup), dequantized to `dtype`: the
// values gguf-py's numpy dequantizer gives, rounded to `dtype`.
at::Tensor ggml_embedding(at::Tensor weight, at::Tensor ids, int64_t qtype, int64_t in_features, at::ScalarType dtype) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.stride(1) == 1, "ggml_embedding: the weight must be a uint8 [rows, row_bytes] CPU tensor");
  auto flat = ids.to(at::kLong).contiguous().view({-1});
  const int64_t n = flat.numel(), rows = weight.size(0);
  const int64_t* id = flat.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < rows, "ggml_embedding: id ", id[r], " is outside the ", rows, " rows");
  auto sizes = ids.sizes().vec();
  sizes.push_back(in_features);
  auto out = weight.new_empty(sizes, weight.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "ggml_embedding", [&] {
    dequantize_rows(weight.const_data_ptr<uint8_t>(), weight.stride(0), id, n, in_features, qtype,
                    out.data_ptr<scalar_t>());
  });
  return out;
}
