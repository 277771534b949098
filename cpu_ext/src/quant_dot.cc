#include "quant_dot.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FREETOKEN_X86 1
#endif

namespace freetoken {

FormatLayout LayoutOf(BankType type) {
  switch (type) {
    case BankType::kF32:
      return {1, 4, 0, false};
    case BankType::kBF16:
      return {1, 2, 0, false};
    case BankType::kQ8_0:
      return {32, 34, 0, false};
    case BankType::kQ4_0:
      return {32, 18, 0, false};
    case BankType::kMxfp4:
      return {32, 17, 0, false};
    case BankType::kNvfp4:
      return {64, 36, 4, false};
    case BankType::kFp8:
      return {128, 132, 0, true};
    case BankType::kQ4_K:
      return {256, 144, 0, false};
    case BankType::kQ5_K:
      return {256, 176, 0, false};
    case BankType::kQ6_K:
      return {256, 210, 0, false};
  }
  return {1, 4, 0, false};
}

static const char* const kNames[] = {"f32", "bf16", "q8_0", "q4_0", "mxfp4", "nvfp4", "fp8", "q4_k", "q5_k", "q6_k"};
constexpr int kNumTypes = sizeof(kNames) / sizeof(kNames[0]);

BankType ParseBankType(const char* name) {
  for (int i = 0; i < kNumTypes; ++i)
    if (std::string(name) == kNames[i]) return static_cast<BankType>(i);
  throw std::invalid_argument(std::string("unknown bank format '") + name + "'; use f32, bf16, q8_0, q4_0, mxfp4, nvfp4, fp8, q4_k, q5_k or q6_k");
}

const char* BankTypeName(BankType type) { return kNames[static_cast<int>(type)]; }

namespace {

// Scalar decoders -----------------------------------------------------------------------------------
inline float Bf16ToF32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float F16ToF32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    uint32_t u = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&v, &u, 4);
  }
  return sign ? -v : v;
}

inline float LoadF32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

inline float E8m0(uint8_t e) {  // 2^(e - 127)
  const uint32_t u = e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if ((b & 0x7F) == 0x7F) mag = NAN;
      v[b] = (b & 0x80) ? -mag : mag;
    }
  }
};
const E4m3Table kE4m3;
constexpr float kE2m1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// The reference tier: one weight at a time.
float DotF32Scalar(const uint8_t* row, const float* x, const void*, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += LoadF32(row + 4 * i) * x[i];
  return acc;
}

float DotBf16Scalar(const uint8_t* row, const float* x, const void*, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t w;
    std::memcpy(&w, row + 2 * i, 2);
    acc += Bf16ToF32(w) * x[i];
  }
  return acc;
}

float DotQ8_0Scalar(const uint8_t* r, const float* x, const void*, int64_t n) {
  float acc = 0.f;
  for (int64_t b = 0; b < n / 32; ++b, r += 34, x += 32) {
    const int8_t* q = reinterpret_cast<const int8_t*>(r + 2);
    float s = 0.f;
    for (int j = 0; j < 32; ++j) s += q[j] * x[j];
    acc += F16ToF32(r) * s;
  }
  return acc;
}

float DotQ4_0Scalar(const uint8_t* r, const float* x, const void*, int64_t n) {
  float acc = 0.f;
  for (int64_t b = 0; b < n / 32; ++b, r += 18, x += 32) {
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += ((r[2 + j] & 15) - 8) * x[j] + ((r[2 + j] >> 4) - 8) * x[j + 16];
    acc += F16ToF32(r) * s;
  }
  return acc;
}

float DotMxfp4Scalar(const uint8_t* r, const float* x, const void*, int64_t n) {
  float acc = 0.f;
  for (int64_t b = 0; b < n / 32; ++b, r += 17, x += 32) {
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += kE2m1[r[1 + j] & 15] * x[j] + kE2m1[r[1 + j] >> 4] * x[j + 16];
    acc += E8m0(r[0]) * s;
  }
  return acc;
}

float DotNvfp4Scalar(const uint8_t* r, const float* x, const void*, int64_t n) {
  float acc = 0.f;
  for (int64_t b = 0; b < n / 64; ++b, r += 36) {
    for (int k = 0; k < 4; ++k, x += 16) {
      const uint8_t* q = r + 4 + 8 * k;
      float s = 0.f;
      for (int j = 0; j < 8; ++j) s += kE2m1[q[j] & 15] * x[j] + kE2m1[q[j] >> 4] * x[j + 8];
      acc += kE4m3.v[r[k]] * s;
    }
  }
  return acc;
}

float DotFp8Scalar(const uint8_t* r, const float* x, const void*, int64_t n) {
  float acc = 0.f;
  for (int64_t i0 = 0; i0 < n; i0 += 128, r += 132) {
    const int64_t m = n - i0 < 128 ? n - i0 : 128;
    float s = 0.f;
    for (int64_t j = 0; j < m; ++j) s += kE4m3.v[r[4 + j]] * x[i0 + j];
    acc += LoadF32(r) * s;
  }
  return acc;
}

// K-quants: super-blocks of 256 weights, sub-blocks j = 0..7 of 32 (docs/FORMATS.md).
// q4_k / q5_k: sub-block j's 6-bit scale and min from the 12 bytes at `s` (ggml's get_scale_min_k4).
inline void KScaleMin(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63, *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
// The unsigned code of weight l (0..31) of sub-block j (q6_k: still offset by 32).
template <BankType T>
inline int KCode(const uint8_t* r, int j, int l) {
  if constexpr (T == BankType::kQ6_K) {
    const int n = j / 4, k = j % 4;
    return ((r[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15) | (((r[128 + 32 * n + l] >> (2 * k)) & 3) << 4);
  } else {
    const uint8_t* qs = r + (T == BankType::kQ4_K ? 16 : 48);
    const int low = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
    return T == BankType::kQ4_K ? low : low | (((r[16 + l] >> j) & 1) << 4);
  }
}

template <BankType T>
float DotKScalar(const uint8_t* r, const float* x, const void*, int64_t n) {
  constexpr int64_t kBytes = T == BankType::kQ4_K ? 144 : T == BankType::kQ5_K ? 176 : 210;
  float acc = 0.f;
  for (int64_t b = 0; b < n / 256; ++b, r += kBytes) {
    for (int j = 0; j < 8; ++j, x += 32) {
      if constexpr (T == BankType::kQ6_K) {
        const float d = F16ToF32(r + 208);
        for (int h = 0; h < 2; ++h) {
          float s = 0.f;
          for (int l = 16 * h; l < 16 * h + 16; ++l) s += (KCode<T>(r, j, l) - 32) * x[l];
          acc += d * static_cast<int8_t>(r[192 + 2 * j + h]) * s;
        }
      } else {
        int sc, m;
        KScaleMin(r + 4, j, &sc, &m);
        float s = 0.f, sx = 0.f;
        for (int l = 0; l < 32; ++l) s += KCode<T>(r, j, l) * x[l], sx += x[l];
        acc += F16ToF32(r) * sc * s - F16ToF32(r + 2) * m * sx;
      }
    }
  }
  return acc;
}

#ifdef FREETOKEN_X86
// AVX2 + FMA + F16C -------------------------------------------------------------------------------
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET inline float Hsum256(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

__attribute__((target("avx2,fma,f16c"), always_inline)) inline float HalfToF32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

AVX2_TARGET float DotF32Avx2(const uint8_t* row, const float* x, const void*, int64_t n) {
  const float* w = reinterpret_cast<const float*>(row);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), acc1);
  }
  return Hsum256(_mm256_add_ps(acc0, acc1)) + DotF32Scalar(row + 4 * i, x + i, nullptr, n - i);
}

AVX2_TARGET float DotBf16Avx2(const uint8_t* row, const float* x, const void*, int64_t n) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 8)));
    acc0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_loadu_ps(x + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), _mm256_loadu_ps(x + i + 8), acc1);
  }
  return Hsum256(_mm256_add_ps(acc0, acc1)) + DotBf16Scalar(row + 2 * i, x + i, nullptr, n - i);
}

// 8 int8 (or uint8 minus `bias`) codes → float32 lanes.
AVX2_TARGET inline __m256 I8x8(const int8_t* q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))); }

AVX2_TARGET float DotQ8_0Avx2(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / 32; ++b, r += 34, x += 32) {
    const int8_t* q = reinterpret_cast<const int8_t*>(r + 2);
    __m256 s = _mm256_mul_ps(I8x8(q), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(I8x8(q + 8), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(I8x8(q + 16), _mm256_loadu_ps(x + 16), s);
    s = _mm256_fmadd_ps(I8x8(q + 24), _mm256_loadu_ps(x + 24), s);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(HalfToF32(r)), s, acc);
  }
  return Hsum256(acc);
}

AVX2_TARGET inline __m256 cvt(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

AVX2_TARGET float DotQ4_0Avx2(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
  for (int64_t b = 0; b < n / 32; ++b, r += 18, x += 32) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, low), eight);  // weights 0..15
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), low), eight);  // weights 16..31
    __m256 s = _mm256_mul_ps(cvt(lo), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(cvt(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(cvt(hi), _mm256_loadu_ps(x + 16), s);
    s = _mm256_fmadd_ps(cvt(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24), s);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(HalfToF32(r)), s, acc);
  }
  return Hsum256(acc);
}

// e2m1 codes (8 in the low bytes of v) → float32: magnitudes by table, sign from bit 3.
AVX2_TARGET inline __m256 E2m1x8(__m128i v) {
  const __m256 mags = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i c = _mm256_cvtepu8_epi32(v);
  const __m256 m = _mm256_permutevar8x32_ps(mags, c);  // uses the low 3 bits
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(m, _mm256_castsi256_ps(sign));
}

AVX2_TARGET float DotMxfp4Avx2(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t b = 0; b < n / 32; ++b, r += 17, x += 32) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 1));
    const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    __m256 s = _mm256_mul_ps(E2m1x8(lo), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(E2m1x8(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(E2m1x8(hi), _mm256_loadu_ps(x + 16), s);
    s = _mm256_fmadd_ps(E2m1x8(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24), s);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(E8m0(r[0])), s, acc);
  }
  return Hsum256(acc);
}

AVX2_TARGET float DotNvfp4Avx2(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t b = 0; b < n / 64; ++b, r += 36) {
    for (int k = 0; k < 4; ++k, x += 16) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 4 + 8 * k));
      __m256 s = _mm256_mul_ps(E2m1x8(_mm_and_si128(raw, low)), _mm256_loadu_ps(x));
      s = _mm256_fmadd_ps(E2m1x8(_mm_and_si128(_mm_srli_epi16(raw, 4), low)), _mm256_loadu_ps(x + 8), s);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(kE4m3.v[r[k]]), s, acc);
    }
  }
  return Hsum256(acc);
}

// e4m3 codes, zero-extended to 16-bit lanes → the float16 of their value / 256 (exact, subnormals
// included): magnitude bits to 7..13 and the sign to 15, by (c << 8) >> 1 (arithmetic) less bit 14.
#define E4M3_TO_F16(op, w) op##_and_si##w(op##_srai_epi16(op##_slli_epi16(c, 8), 1), op##_set1_epi16(static_cast<short>(0xBFFF)))

// fp8 rows are read one at a time; the executor's next row (the same expert's, contiguous) is
// prefetched one row ahead, tile by tile, as the int8 kernels prefetch their next rows.
inline void PrefetchNextRowTile(const uint8_t* tile, int64_t row_bytes) {
  const char* p = reinterpret_cast<const char*>(tile + row_bytes);
  _mm_prefetch(p, _MM_HINT_T0);
  _mm_prefetch(p + 64, _MM_HINT_T0);
  _mm_prefetch(p + 131, _MM_HINT_T0);
}

AVX2_TARGET float DotFp8Avx2(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  float tail = 0.f;
  const int64_t row_bytes = (n + 127) / 128 * 132;
  for (int64_t i0 = 0; i0 < n; i0 += 128, r += 132) {
    const int64_t m = n - i0 < 128 ? n - i0 : 128;
    PrefetchNextRowTile(r, row_bytes);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= m; j += 16) {  // 16 codes a step, two chains
      const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 4 + j)));
      const __m256i h = E4M3_TO_F16(_mm256, 256);
      s0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_loadu_ps(x + i0 + j), s0);
      s1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_loadu_ps(x + i0 + j + 8), s1);
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(LoadF32(r) * 256.f), _mm256_add_ps(s0, s1), acc);
    for (; j < m; ++j) tail += LoadF32(r) * kE4m3.v[r[4 + j]] * x[i0 + j];
  }
  return Hsum256(acc) + tail;
}

// AVX-512F (+F16C) ---------------------------------------------------------------------------------
#define AVX512_TARGET __attribute__((target("avx512f,fma,f16c")))

AVX512_TARGET float DotF32Avx512(const uint8_t* row, const float* x, const void*, int64_t n) {
  const float* w = reinterpret_cast<const float*>(row);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + DotF32Scalar(row + 4 * i, x + i, nullptr, n - i);
}

AVX512_TARGET float DotBf16Avx512(const uint8_t* row, const float* x, const void*, int64_t n) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
    __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 16)));
    acc0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_loadu_ps(x + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), _mm512_loadu_ps(x + i + 16), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + DotBf16Scalar(row + 2 * i, x + i, nullptr, n - i);
}

AVX512_TARGET inline float Half512(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

AVX512_TARGET float DotQ8_0Avx512(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < n / 32; ++b, r += 34, x += 32) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 18));
    __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), _mm512_loadu_ps(x));
    s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), _mm512_loadu_ps(x + 16), s);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(Half512(r)), s, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

AVX512_TARGET float DotQ4_0Avx512(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
  for (int64_t b = 0; b < n / 32; ++b, r += 18, x += 32) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(c, low), eight));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(c, 4), eight));
    __m512 s = _mm512_mul_ps(lo, _mm512_loadu_ps(x));
    s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), s);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(Half512(r)), s, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

AVX512_TARGET float DotMxfp4Avx512(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 lut = _mm512_loadu_ps(kE2m1);
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < n / 32; ++b, r += 17, x += 32) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 1)));
    __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(c, low), lut), _mm512_loadu_ps(x));
    s = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut), _mm512_loadu_ps(x + 16), s);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(E8m0(r[0])), s, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

AVX512_TARGET float DotNvfp4Avx512(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 lut = _mm512_loadu_ps(kE2m1);
  const __m512i low = _mm512_set1_epi32(15);
  // Lanes 0-7 take the low nibbles of a sub-block's 8 bytes, lanes 8-15 the high ones.
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  for (int64_t b = 0; b < n / 64; ++b, r += 36) {
    for (int k = 0; k < 4; ++k, x += 16) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 4 + 8 * k));
      const __m512i c = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(raw, raw));
      const __m512 v = _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(c, shift), low), lut);
      acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(kE4m3.v[r[k]]), v), _mm512_loadu_ps(x), acc);
    }
  }
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f,avx512bw,fma,f16c"))) float DotFp8Avx512(const uint8_t* r, const float* x, const void*, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  float tail = 0.f;
  const int64_t row_bytes = (n + 127) / 128 * 132;
  for (int64_t i0 = 0; i0 < n; i0 += 128, r += 132) {
    const int64_t m = n - i0 < 128 ? n - i0 : 128;
    PrefetchNextRowTile(r, row_bytes);
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= m; j += 32) {  // 32 codes a step, two chains
      const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 4 + j)));
      const __m512i h = E4M3_TO_F16(_mm512, 512);
      s0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), _mm512_loadu_ps(x + i0 + j), s0);
      s1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), _mm512_loadu_ps(x + i0 + j + 16), s1);
    }
    acc = _mm512_fmadd_ps(_mm512_set1_ps(LoadF32(r) * 256.f), _mm512_add_ps(s0, s1), acc);
    for (; j < m; ++j) tail += LoadF32(r) * kE4m3.v[r[4 + j]] * x[i0 + j];
  }
  return _mm512_reduce_add_ps(acc) + tail;
}

// bf16 × bf16 dot products with float32 accumulation (vdpbf16ps); the vector is rounded to bf16.
__attribute__((target("avx512f,avx512bf16"))) float DotBf16Avx512Bf16(const uint8_t* row, const float* x, const void* prep, int64_t n) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
  const uint16_t* xb = static_cast<const uint16_t*>(prep);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512i a0 = _mm512_loadu_si512(w + i), b0 = _mm512_loadu_si512(xb + i);
    __m512i a1 = _mm512_loadu_si512(w + i + 32), b1 = _mm512_loadu_si512(xb + i + 32);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)a0, (__m512bh)b0);
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)a1, (__m512bh)b1);
  }
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; i < n; ++i) acc += Bf16ToF32(w[i]) * Bf16ToF32(xb[i]);
  return acc;
}

// int8 activations (Prepare) × 4- and 8-bit weights with VNNI (q8_0, q4_0, mxfp4, nvfp4), one
// block of 32 weights per 256-bit dpbusd, four rows at a time (they share the activation loads and
// the scale conversion). dpbusd multiplies unsigned by signed bytes, so the weights enter as
// unsigned codes: q4_0's stored 0..15 (value + 8), q8_0's q + 128, and the e2m1 formats' doubled
// values (−12..12) + 12 through a byte table. Prepare stores per block of 32 activations their
// int8 codes in the order the kernel reads the weights, eight int32 lane sums times −offset (the
// accumulator's start, which takes the offset back off), and the block's float scale.
struct VnniPrep {
  const int8_t* q;   // [nb, 32] codes
  const int32_t* c;  // [nb, 8]  −offset × Σ codes of each group of 4
  const float* d;    // [nb] activation scales
  const float* s;    // [nb] d × Σ codes (the K-quants' mins)
};
inline int64_t VnniPrepBytes(int64_t nb) { return nb * 72; }
inline VnniPrep VnniView(const void* prep, int64_t nb) {
  const int8_t* q = static_cast<const int8_t*>(prep);
  const int32_t* c = reinterpret_cast<const int32_t*>(q + 32 * nb);
  const float* d = reinterpret_cast<const float*>(c + 8 * nb);
  return {q, c, d, d + nb};
}

#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
// AVX2 code shared by the float and int8 kernels, inlined into each (a call per block would cost
// the VNNI kernel half its rate).
#define SHARED_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline))

SHARED_AVX2 inline float Hsum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// 16 bytes of nibbles → 32 codes: byte j's low nibble at j, its high nibble at 16 + j.
SHARED_AVX2 inline __m256i Nibbles(const uint8_t* p) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

// e2m1 codes → doubled value + 12 (0..24), a byte table for vpshufb.
SHARED_AVX2 inline __m256i E2m1Codes(__m256i nibbles) {
  const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,  //
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  return _mm256_shuffle_epi8(lut, nibbles);
}

// f16 scales of R ≤ 4 rows' blocks: gathered into one register, converted once.
template <int R>
SHARED_AVX2 inline void HalfScales(const uint8_t* b, int64_t stride, float d, __m256* s) {
  uint64_t h = 0;
  for (int i = 0; i < R; ++i) {
    uint16_t v;
    std::memcpy(&v, b + i * stride, 2);
    h |= static_cast<uint64_t>(v) << (16 * i);
  }
  alignas(16) float f[4];
  _mm_store_ps(f, _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h))), _mm_set1_ps(d)));
  for (int i = 0; i < R; ++i) s[i] = _mm256_set1_ps(f[i]);
}

// The VNNI tier takes two blocks b, b + 1 at once in 512-bit registers: their codes as the 256-bit
// code builds one block's, b's in the low half; per row a scale vector whose low eight lanes are
// b's scale × d[b] and whose high eight are b + 1's × d[b + 1].
#define VNNI_INLINE __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))

// 16 bytes at p0 and 16 at p1 as one register.
VNNI_INLINE inline __m256i Load2x16(const uint8_t* p0, const uint8_t* p1) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
}
// [A, B] (16 bytes of nibbles each) → Nibbles(A), Nibbles(B).
VNNI_INLINE inline __m512i SplitNibbles(__m256i v) {
  const __m512i w = _mm512_castsi256_si512(v);
  return _mm512_and_si512(_mm512_srlv_epi64(_mm512_shuffle_i64x2(w, w, 0x50), _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                          _mm512_set1_epi8(15));
}
VNNI_INLINE inline __m512i E2m1Codes2(__m512i nibbles) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  return _mm512_shuffle_epi8(lut, nibbles);
}
// [d[0], d[1]] repeated over eight lanes.
VNNI_INLINE inline __m256 PairScales(const float* d) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(d)));
}
// Lanes [r0 b, r0 b+1, r1 b, ...] of f → row i's scale vector.
template <int R>
VNNI_INLINE inline void SpreadPairs(__m256 f, __m512* s) {
  for (int i = 0; i < R; ++i)
    s[i] = _mm512_permutexvar_ps(_mm512_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i + 1,
                                                   2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1),
                                 _mm512_castps256_ps512(f));
}
// The f16 scales of blocks b (at b0) and b + 1 (kBytes on) in R rows.
template <int R, int64_t kBytes>
VNNI_INLINE inline void HalfScales2(const uint8_t* b0, int64_t stride, const float* d, __m512* s) {
  uint64_t h[2] = {0, 0};
  for (int i = 0; i < R; ++i) {
    uint16_t v0, v1;
    std::memcpy(&v0, b0 + i * stride, 2), std::memcpy(&v1, b0 + i * stride + kBytes, 2);
    h[i / 2] |= (static_cast<uint64_t>(v0) | static_cast<uint64_t>(v1) << 16) << (32 * (i % 2));
  }
  const __m128i halves = _mm_set_epi64x(static_cast<int64_t>(h[1]), static_cast<int64_t>(h[0]));
  SpreadPairs<R>(_mm256_mul_ps(_mm256_cvtph_ps(halves), PairScales(d)), s);
}

// The four formats as the kernel sees them, per block b of 32 weights of a row: kBytes, its bytes
// (on average); Codes, its unsigned codes; Scales<R>, the scale per lane of the block in R rows
// (stride bytes apart) times the activation scale d.
struct Q4_0Vnni {
  static constexpr int64_t kBytes = 18;
  SHARED_AVX2 static __m256i Codes(const uint8_t* row, int64_t b) { return Nibbles(row + b * kBytes + 2); }
  template <int R>
  SHARED_AVX2 static void Scales(const uint8_t* row, int64_t stride, int64_t b, float d, __m256* s) {
    HalfScales<R>(row + b * kBytes, stride, d, s);
  }
  VNNI_INLINE static __m512i Codes2(const uint8_t* row, int64_t b) {
    return SplitNibbles(Load2x16(row + b * kBytes + 2, row + (b + 1) * kBytes + 2));
  }
  template <int R>
  VNNI_INLINE static void Scales2(const uint8_t* row, int64_t stride, int64_t b, const float* d, __m512* s) {
    HalfScales2<R, kBytes>(row + b * kBytes, stride, d, s);
  }
};
struct Q8_0Vnni {
  static constexpr int64_t kBytes = 34;
  SHARED_AVX2 static __m256i Codes(const uint8_t* row, int64_t b) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBytes + 2)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  template <int R>
  SHARED_AVX2 static void Scales(const uint8_t* row, int64_t stride, int64_t b, float d, __m256* s) {
    HalfScales<R>(row + b * kBytes, stride, d, s);
  }
  VNNI_INLINE static __m512i Codes2(const uint8_t* row, int64_t b) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBytes + 2));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (b + 1) * kBytes + 2));
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  template <int R>
  VNNI_INLINE static void Scales2(const uint8_t* row, int64_t stride, int64_t b, const float* d, __m512* s) {
    HalfScales2<R, kBytes>(row + b * kBytes, stride, d, s);
  }
};
struct Mxfp4Vnni {  // an e8m0 scale, then q4_0's nibble order
  static constexpr int64_t kBytes = 17;
  SHARED_AVX2 static __m256i Codes(const uint8_t* row, int64_t b) { return E2m1Codes(Nibbles(row + b * kBytes + 1)); }
  template <int R>
  SHARED_AVX2 static void Scales(const uint8_t* row, int64_t stride, int64_t b, float d, __m256* s) {
    for (int i = 0; i < R; ++i) s[i] = _mm256_set1_ps(0.5f * E8m0(row[i * stride + b * kBytes]) * d);
  }
  VNNI_INLINE static __m512i Codes2(const uint8_t* row, int64_t b) {
    return E2m1Codes2(SplitNibbles(Load2x16(row + b * kBytes + 1, row + (b + 1) * kBytes + 1)));
  }
  template <int R>
  VNNI_INLINE static void Scales2(const uint8_t* row, int64_t stride, int64_t b, const float* d, __m512* s) {
    // the R rows' exponent pairs as 32-bit lanes [r0 b, r0 b+1, r1 b, ...] → 2^(e − 127) as E8m0
    // makes it (e << 23, and for e = 0 the subnormal 2^−127: the max with its bits)
    uint64_t e = 0;
    for (int i = 0; i < R; ++i) {
      const uint8_t* p = row + i * stride + b * kBytes;
      e |= (static_cast<uint64_t>(p[0]) | static_cast<uint64_t>(p[kBytes]) << 8) << (16 * i);
    }
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(e))), 23);
    const __m256 f = _mm256_castsi256_ps(_mm256_max_epi32(bits, _mm256_set1_epi32(0x00400000)));
    SpreadPairs<R>(_mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(0.5f)), PairScales(d)), s);
  }
};
// nvfp4: 36-byte super-blocks of 64 weights, four e4m3 scales (one per 16) then four sub-blocks
// of 8 bytes (low nibbles: weights 0..7, high: 8..15). A 32-weight block is two sub-blocks A, B:
// its codes are [A 0..7, B 0..7, A 8..15, B 8..15] (Prepare stores activations in that order), so
// lanes 0-1 and 4-5 take A's scale, 2-3 and 6-7 B's.
struct Nvfp4Vnni {
  static constexpr int64_t kBytes = 18;
  SHARED_AVX2 static __m256i Codes(const uint8_t* row, int64_t b) { return E2m1Codes(Nibbles(row + (b / 2) * 36 + 4 + 16 * (b % 2))); }
  template <int R>
  SHARED_AVX2 static void Scales(const uint8_t* row, int64_t stride, int64_t b, float d, __m256* s) {
    // the R rows' scale pairs (A, B) in one register, converted at once as fp8's weights are:
    // 16-bit lanes [A0 B0 A1 B1 ...] → float16 of value / 256 → float32 × 256 × d / 2
    uint64_t pairs = 0;
    for (int i = 0; i < R; ++i) {
      uint16_t v;
      std::memcpy(&v, row + i * stride + (b / 2) * 36 + 2 * (b % 2), 2);
      pairs |= static_cast<uint64_t>(v) << (16 * i);
    }
    const __m128i c = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(pairs)));
    const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(E4M3_TO_F16(_mm, 128)), _mm256_set1_ps(128.f * d));
    for (int i = 0; i < R; ++i)
      s[i] = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1));
  }
  // blocks b (even) and b + 1: one super-block, its four sub-blocks' nibbles in one 256-bit load
  VNNI_INLINE static __m512i Codes2(const uint8_t* row, int64_t b) {
    return E2m1Codes2(SplitNibbles(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (b / 2) * 36 + 4))));
  }
  template <int R>
  VNNI_INLINE static void Scales2(const uint8_t* row, int64_t stride, int64_t b, const float* d, __m512* s) {
    // the R rows' four scales in 16-bit lanes [r0 s0..s3, r1 s0..s3, ...], converted at once; block
    // b's two sub-blocks take d[b], block b + 1's d[b + 1]
    uint64_t w[2] = {0, 0};
    for (int i = 0; i < R; ++i) {
      uint32_t v;
      std::memcpy(&v, row + i * stride + (b / 2) * 36, 4);
      w[i / 2] |= static_cast<uint64_t>(v) << (32 * (i % 2));
    }
    const __m256i c = _mm256_cvtepu8_epi16(_mm_set_epi64x(static_cast<int64_t>(w[1]), static_cast<int64_t>(w[0])));
    const __m128 dd = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d)));
    const __m512 ds = _mm512_mul_ps(_mm512_broadcast_f32x4(_mm_unpacklo_ps(dd, dd)), _mm512_set1_ps(128.f));
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(E4M3_TO_F16(_mm256, 256)), ds);
    for (int i = 0; i < R; ++i)
      s[i] = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3), _mm512_set1_epi32(4 * i)), f);
  }
};

// The kernels walk R rows at once, more streams than the hardware prefetchers follow well (from
// DRAM, four rows in step read at half the rate of one). The R rows after them are contiguous, so
// each step prefetches its share of them as one stream: kBytes bytes from `p`.
template <int64_t kBytes>
SHARED_AVX2 inline void PrefetchAhead(const uint8_t* p) {
  for (int64_t o = 0; o < kBytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + kBytes - 1), _MM_HINT_T0);
}

// dpbusd without VNNI: u8 × s8 pairs summed to int16 (exact while the codes stay below 128, as
// q4_0's and the e2m1 formats' do), then to the int32 lanes.
SHARED_AVX2 inline __m256i DpbusdAvx2(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}

// Σ over a row's blocks for R rows (stride bytes apart) at once, a block a step; DOT is the dpbusd.
#define INT8_ROWS_BODY(DOT)                                                                                         \
  __m256 acc[R];                                                                                                    \
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();                                                         \
  for (int64_t b = 0; b < nb; ++b) {                                                                                \
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q + 32 * b));                          \
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.c + 8 * b));                           \
    __m256 s[R];                                                                                                    \
    Fmt::template Scales<R>(r, stride, b, p.d[b], s);                                                               \
    PrefetchAhead<R * Fmt::kBytes>(r + R * stride + b * R * Fmt::kBytes);                                           \
    for (int i = 0; i < R; ++i)                                                                                     \
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(c, Fmt::Codes(r + i * stride, b), q)), s[i], acc[i]);         \
  }                                                                                                                 \
  for (int i = 0; i < R; ++i) out[i] = Hsum(acc[i]);

template <class Fmt, int R>
VNNI_TARGET inline void VnniRows(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
  INT8_ROWS_BODY(_mm256_dpbusd_epi32)
}
template <class Fmt, int R>
AVX2_TARGET inline void Avx2Int8Rows(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
  INT8_ROWS_BODY(DpbusdAvx2)
}
// The same sum two blocks a step in 512-bit registers (an odd count's last block as VnniRows
// takes it).
template <class Fmt, int R>
VNNI_TARGET inline void Vnni512Rows(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t pairs = nb / 2;
  for (int64_t b = 0; b < 2 * pairs; b += 2) {
    const __m512i q = _mm512_loadu_si512(p.q + 32 * b);
    const __m512i c = _mm512_loadu_si512(p.c + 8 * b);
    __m512 s[R];
    Fmt::template Scales2<R>(r, stride, b, p.d + b, s);
    PrefetchAhead<2 * R * Fmt::kBytes>(r + R * stride + b * R * Fmt::kBytes);
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, Fmt::Codes2(r + i * stride, b), q)), s[i], acc[i]);
  }
  float last[R] = {};
  if (nb % 2) {
    const VnniPrep rest{p.q + 64 * pairs, p.c + 16 * pairs, p.d + 2 * pairs, p.s + 2 * pairs};
    VnniRows<Fmt, R>(r + 2 * pairs * Fmt::kBytes, stride, rest, 1, last);
  }
  for (int i = 0; i < R; ++i) out[i] = _mm512_reduce_add_ps(acc[i]) + last[i];
}

// A row kernel as a type: Kernel::Rows<R>(rows, stride, prep, blocks, out) for R = 4 and 1.
template <class Fmt>
struct VnniKernel {
  template <int R>
  VNNI_TARGET static void Rows(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
    VnniRows<Fmt, R>(r, stride, p, nb, out);
  }
};
template <class Fmt>
struct Vnni512Kernel {
  template <int R>
  VNNI_TARGET static void Rows(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
    Vnni512Rows<Fmt, R>(r, stride, p, nb, out);
  }
};
template <class Fmt>
struct Avx2Int8Kernel {
  template <int R>
  AVX2_TARGET static void Rows(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
    Avx2Int8Rows<Fmt, R>(r, stride, p, nb, out);
  }
};

// All `rows` rows, four at a time, then one at a time; and one row (DotFn).
// (AVX2 code: it calls the kernel's rows, VNNI or not.)
template <class Kernel>
AVX2_TARGET void DotRowsOf(const uint8_t* r, int64_t stride, int64_t rows, const float*, const void* prep, int64_t n, float* out) {
  const int64_t nb = n / 32;
  const VnniPrep p = VnniView(prep, nb);
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) Kernel::template Rows<4>(r + i * stride, stride, p, nb, out + i);
  for (; i < rows; ++i) Kernel::template Rows<1>(r + i * stride, stride, p, nb, out + i);
}
template <class Kernel>
AVX2_TARGET float DotOf(const uint8_t* r, const float* x, const void* prep, int64_t n) {
  float out;
  DotRowsOf<Kernel>(r, 0, 1, x, prep, n, &out);
  return out;
}


// K-quants: block b of 32 is sub-block j = b % 8 of super-block b / 8. A row's scales are decoded
// once per super-block into 8 lanes per sub-block (q6_k: two int8 scales per 32 weights split the
// lanes 4 + 4). q4_k and q5_k have mins (kMins): w = d·sc·q − dmin·m; their codes enter dpbusd as
// they are and the mins come off once per super-block as Σ_j dmin·m[j] · (activation block j's
// d·Σ codes). q6_k is q − 32: Prepare's lane sums (−32 × Σ codes) start its dpbusd.
SHARED_AVX2 inline __m256i Shift4(__m256i v, int odd) { return odd ? _mm256_srli_epi16(v, 4) : v; }
SHARED_AVX2 inline __m256i Load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
template <BankType T>
struct KQuant {
  static constexpr int64_t kSuper = T == BankType::kQ4_K ? 144 : T == BankType::kQ5_K ? 176 : 210;
  static constexpr bool kMins = T != BankType::kQ6_K;
  SHARED_AVX2 static inline __m256i Codes(const uint8_t* r, int j) {  // r: the super-block
    const __m256i low = _mm256_set1_epi8(15);
    if constexpr (T == BankType::kQ6_K) {
      const int n = j / 4, k = j % 4;
      const __m256i lo = _mm256_and_si256(Shift4(Load32(r + 64 * n + 32 * (k % 2)), k / 2), low);
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(Load32(r + 128 + 32 * n), _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
      return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    } else {
      const __m256i lo = _mm256_and_si256(Shift4(Load32(r + (T == BankType::kQ4_K ? 16 : 48) + 32 * (j / 2)), j % 2), low);
      if constexpr (T == BankType::kQ4_K) return lo;
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(Load32(r + 16), _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
      return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
  }
  // A super-block's scales as floats: q4_k / q5_k: sc[j]·d in lanes j = 0..7 of a register, and
  // m[j]·dmin beside them (the 12 packed bytes unpacked 4 at a time in 32-bit words); q6_k: its
  // 16 int8 scales times d in the 16 lanes of a 512-bit register.
  struct Scales {
    __m512 sc;
    __m256 mins;
  };
  VNNI_TARGET static Scales Decode(const uint8_t* r) {
    if constexpr (T == BankType::kQ6_K) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 192))));
      return {_mm512_mul_ps(v, _mm512_set1_ps(HalfToF32(r + 208))), _mm256_setzero_ps()};
    } else {
      uint32_t a, b, c;
      std::memcpy(&a, r + 4, 4), std::memcpy(&b, r + 8, 4), std::memcpy(&c, r + 12, 4);
      const uint32_t sc_lo = a & 0x3F3F3F3Fu, m_lo = b & 0x3F3F3F3Fu;
      const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u), m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc_lo | uint64_t{sc_hi} << 32))));
      const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(m_lo | uint64_t{m_hi} << 32))));
      return {_mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_set1_ps(HalfToF32(r)))), _mm256_mul_ps(m, _mm256_set1_ps(HalfToF32(r + 2)))};
    }
  }
  // Sub-block j's scale in each dpbusd lane.
  VNNI_TARGET static __m256 Lanes(const __m512& sc, int j) {
    if constexpr (T == BankType::kQ6_K) {
      const __m512i idx = _mm512_castsi256_si512(_mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1));
      return _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, sc));
    } else {
      return _mm256_permutevar8x32_ps(_mm512_castps512_ps256(sc), _mm256_set1_epi32(j));
    }
  }
};

template <BankType T, int R>
VNNI_TARGET inline void KRows(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
  using K = KQuant<T>;
  __m256 acc[R], accm[R];
  for (int i = 0; i < R; ++i) acc[i] = accm[i] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    typename K::Scales sc[R];
    for (int i = 0; i < R; ++i) sc[i] = K::Decode(r + i * stride + sb * K::kSuper);
    if constexpr (K::kMins) {
      const __m256 bsum = _mm256_loadu_ps(p.s + 8 * sb);
      for (int i = 0; i < R; ++i) accm[i] = _mm256_fmadd_ps(sc[i].mins, bsum, accm[i]);
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * sb + j;
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q + 32 * b));
      const __m256i start = K::kMins ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.c + 8 * b));
      const __m256 da = _mm256_set1_ps(p.d[b]);
      PrefetchAhead<R * K::kSuper / 8>(r + R * stride + b * R * K::kSuper / 8);
      for (int i = 0; i < R; ++i) {
        const __m256i dot = _mm256_dpbusd_epi32(start, K::Codes(r + i * stride + sb * K::kSuper, j), q);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(K::Lanes(sc[i].sc, j), da), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) out[i] = Hsum(_mm256_sub_ps(acc[i], accm[i]));
}

// The float tiers (AVX2, AVX-512F): a sub-block's 32 codes as in the VNNI kernel, widened to
// float32 and multiplied by x; q4_k / q5_k subtract dmin·m[j]·Σx.
template <BankType T>
AVX2_TARGET float DotKAvx2(const uint8_t* r, const float* x, const void*, int64_t n) {
  using K = KQuant<T>;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / 256; ++b, r += K::kSuper) {
    for (int j = 0; j < 8; ++j, x += 32) {
      const __m256i c = K::Codes(r, j);
      const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
      __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
      const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
      if constexpr (T == BankType::kQ6_K) {
        const __m256 off = _mm256_set1_ps(32.f), d = _mm256_set1_ps(HalfToF32(r + 208));
        const __m256 a = _mm256_fmadd_ps(_mm256_sub_ps(q[1], off), x1, _mm256_mul_ps(_mm256_sub_ps(q[0], off), x0));
        const __m256 b2 = _mm256_fmadd_ps(_mm256_sub_ps(q[3], off), x3, _mm256_mul_ps(_mm256_sub_ps(q[2], off), x2));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(static_cast<int8_t>(r[192 + 2 * j]))), a, acc);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(static_cast<int8_t>(r[193 + 2 * j]))), b2, acc);
      } else {
        int sc, m;
        KScaleMin(r + 4, j, &sc, &m);
        const __m256 s = _mm256_fmadd_ps(q[3], x3, _mm256_fmadd_ps(q[2], x2, _mm256_fmadd_ps(q[1], x1, _mm256_mul_ps(q[0], x0))));
        const __m256 sx = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(HalfToF32(r) * sc), s, acc);
        acc = _mm256_fnmadd_ps(_mm256_set1_ps(HalfToF32(r + 2) * m), sx, acc);
      }
    }
  }
  return Hsum256(acc);
}

template <BankType T>
struct KKernel {
  template <int R>
  VNNI_TARGET static void Rows(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
    KRows<T, R>(r, stride, p, nb, out);
  }
};
#endif

// x → the VnniPrep of its blocks of 32: codes q = round(x / d), d = max|x| / 127 (halves away from
// zero), in natural order or nvfp4's [0..7, 16..23, 8..15, 24..31]; lane sums times −offset.
// The reference; PrepareQ8Avx2 computes the same bytes eight lanes at a time.
void PrepareQ8Scalar(const float* x, int64_t n, uint8_t* out, int offset, bool nvfp4_order) {
  const int64_t nb = n / 32;
  int8_t* qs = reinterpret_cast<int8_t*>(out);
  int32_t* cs = reinterpret_cast<int32_t*>(out + 32 * nb);
  float* ds = reinterpret_cast<float*>(cs + 8 * nb);
  float* ss = ds + nb;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int8_t* q = qs + 32 * b;
    for (int j = 0; j < 32; ++j) {
      const int src = nvfp4_order ? (j & 7) + ((j >> 3) & 1) * 16 + (j >> 4) * 8 : j;
      q[j] = static_cast<int8_t>(std::lround(xb[src] * id));
    }
    int sum = 0;
    for (int l = 0; l < 8; ++l) {
      const int g = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
      cs[8 * b + l] = -offset * g, sum += g;
    }
    ds[b] = d, ss[b] = d * static_cast<float>(sum);
  }
}

#ifdef FREETOKEN_X86
// PrepareQ8Scalar's bytes, eight lanes at a time: a decode job prepares its token (H values) and
// each item's hidden units (F) on one thread before its phases, where the scalar loop's lround
// calls took 7 ns a value. Rounding: trunc(v + copysign(0.49999997, v)) equals lround(v) for
// every float |v| <= 128 (checked exhaustively), and |v| <= 127 here.
AVX2_TARGET void PrepareQ8Avx2(const float* x, int64_t n, uint8_t* out, int offset, bool nvfp4_order) {
  const int64_t nb = n / 32;
  int8_t* qs = reinterpret_cast<int8_t*>(out);
  int32_t* cs = reinterpret_cast<int32_t*>(out + 32 * nb);
  float* ds = reinterpret_cast<float*>(cs + 8 * nb);
  float* ss = ds + nb;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), half = _mm256_set1_ps(0.49999997f);
  const __m256 sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), neg_offset = _mm256_set1_epi32(-offset);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    if (nvfp4_order) std::swap(v[1], v[2]);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                             _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_mul_ps(v[i], vid);
      q[i] = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_or_ps(half, _mm256_and_ps(t, sign_mask))));
    }
    // int32 → int8 in order: the packs interleave 128-bit lanes, the permutation undoes it
    const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + 32 * b), _mm256_permutevar8x32_epi32(q16, order));
    // sums of each group of 4 codes, groups in order
    const __m256i g = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cs + 8 * b), _mm256_mullo_epi32(g, neg_offset));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(g), _mm256_extracti128_si256(g, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    ds[b] = d, ss[b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}
#endif

inline bool UsesVnni(IsaTier tier, BankType type) {
  return tier == IsaTier::kAvx512Bf16 && type != BankType::kF32 && type != BankType::kBF16 && type != BankType::kFp8;
}
// The AVX2 tier's int8 kernels: the formats whose codes stay below 128 (DpbusdAvx2) and whose
// scales need no AVX-512 (not the K-quants').
inline bool UsesAvx2Int8(IsaTier tier, BankType type) {
  return tier == IsaTier::kAvx2Fma && (type == BankType::kQ4_0 || type == BankType::kMxfp4 || type == BankType::kNvfp4);
}
inline bool UsesInt8(IsaTier tier, BankType type) { return UsesVnni(tier, type) || UsesAvx2Int8(tier, type); }
// What Prepare's lane sums take back: the codes' offset from the signed value (mins formats: 1,
// so that the lane sums are −Σ codes).
inline int VnniOffset(BankType type) {
  switch (type) {
    case BankType::kQ4_0:
      return 8;
    case BankType::kQ8_0:
      return 128;
    case BankType::kQ6_K:
      return 32;
    case BankType::kQ4_K:
    case BankType::kQ5_K:
      return 1;
    default:
      return 12;  // e2m1 codes as twice their value + 12
  }
}
inline bool UsesBf16Dot(IsaTier tier, BankType type) {
  return tier == IsaTier::kAvx512Bf16 && type == BankType::kBF16;
}

#define K_SCALAR DotKScalar<BankType::kQ4_K>, DotKScalar<BankType::kQ5_K>, DotKScalar<BankType::kQ6_K>
#define K_AVX2 DotKAvx2<BankType::kQ4_K>, DotKAvx2<BankType::kQ5_K>, DotKAvx2<BankType::kQ6_K>
constexpr DotFn kScalar[] = {DotF32Scalar, DotBf16Scalar, DotQ8_0Scalar, DotQ4_0Scalar, DotMxfp4Scalar, DotNvfp4Scalar, DotFp8Scalar, K_SCALAR};
#ifdef FREETOKEN_X86
// The K-quants' float32 tiers share the AVX2 kernel (AVX-512F machines have AVX2); from
// avx512_bf16 on they have VNNI ones.
constexpr DotFn kAvx2[] = {DotF32Avx2, DotBf16Avx2, DotQ8_0Avx2, DotQ4_0Avx2, DotMxfp4Avx2, DotNvfp4Avx2, DotFp8Avx2, K_AVX2};
constexpr DotFn kAvx512[] = {DotF32Avx512, DotBf16Avx512, DotQ8_0Avx512, DotQ4_0Avx512, DotMxfp4Avx512, DotNvfp4Avx512, DotFp8Avx512, K_AVX2};
#endif
static_assert(sizeof(kScalar) / sizeof(kScalar[0]) == kNumTypes);

}  // namespace

int64_t PrepBytes(IsaTier tier, BankType type, int64_t n) {
#ifdef FREETOKEN_X86
  if (UsesInt8(tier, type)) return VnniPrepBytes(n / 32);
  if (UsesBf16Dot(tier, type)) return 2 * n;
#endif
  (void)tier, (void)type, (void)n;
  return 0;
}

bool PreparesInt8(IsaTier tier, BankType type) {
#ifdef FREETOKEN_X86
  return UsesInt8(tier, type);
#else
  (void)tier, (void)type;
  return false;
#endif
}

void PrepareInt8Reference(BankType type, const float* x, int64_t n, uint8_t* out) {
  PrepareQ8Scalar(x, n, out, VnniOffset(type), type == BankType::kNvfp4);
}

void Prepare(IsaTier tier, BankType type, const float* x, int64_t n, uint8_t* out) {
#ifdef FREETOKEN_X86
  if (UsesInt8(tier, type)) return PrepareQ8Avx2(x, n, out, VnniOffset(type), type == BankType::kNvfp4);
  if (UsesBf16Dot(tier, type)) {
    for (int64_t i = 0; i < n; ++i) {  // round to nearest even
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      u += 0x7fff + ((u >> 16) & 1);
      const uint16_t h = static_cast<uint16_t>(u >> 16);
      std::memcpy(out + 2 * i, &h, 2);
    }
  }
#endif
  (void)tier, (void)type, (void)x, (void)n, (void)out;
}

int VnniBits() {  // quant_dot.h
  static const int bits = [] {
    const char* v = std::getenv("FREETOKEN_VNNI_BITS");
    if (!v || !*v || std::string(v) == "512") return 512;
    if (std::string(v) == "256") return 256;
    throw std::invalid_argument(std::string("FREETOKEN_VNNI_BITS must be 512 or 256, not '") + v + "'");
  }();
  return bits;
}

#ifdef FREETOKEN_X86
namespace {
// The int8 kernel of (tier, type) as both entry points; nulls where the pair has none.
struct Int8Fns {
  DotFn dot;
  DotRowsFn rows;
};
template <class Kernel>
Int8Fns Fns() {
  return {DotOf<Kernel>, DotRowsOf<Kernel>};
}
// The kernels of one kind (Kernel<Fmt>) for the four block formats (q8_0 only where kQ8_0:
// the AVX2 kernel's pairwise sums do not hold its codes up to 127, UsesAvx2Int8); nulls for
// the others.
template <template <class> class Kernel, bool kQ8_0 = true>
Int8Fns BlockFns(BankType type) {
  switch (type) {
    case BankType::kQ4_0:
      return Fns<Kernel<Q4_0Vnni>>();
    case BankType::kQ8_0:
      if constexpr (kQ8_0) return Fns<Kernel<Q8_0Vnni>>();
      return {nullptr, nullptr};
    case BankType::kMxfp4:
      return Fns<Kernel<Mxfp4Vnni>>();
    case BankType::kNvfp4:
      return Fns<Kernel<Nvfp4Vnni>>();
    default:
      return {nullptr, nullptr};
  }
}
Int8Fns Int8Kernels(IsaTier tier, BankType type) {
  if (UsesAvx2Int8(tier, type)) return BlockFns<Avx2Int8Kernel, false>(type);
  if (!UsesVnni(tier, type)) return {nullptr, nullptr};
  switch (type) {
    case BankType::kQ4_K:
      return Fns<KKernel<BankType::kQ4_K>>();
    case BankType::kQ5_K:
      return Fns<KKernel<BankType::kQ5_K>>();
    case BankType::kQ6_K:
      return Fns<KKernel<BankType::kQ6_K>>();
    default:
      return VnniBits() == 512 ? BlockFns<Vnni512Kernel>(type) : BlockFns<VnniKernel>(type);
  }
}
}  // namespace
#endif

DotFn DotFor(IsaTier tier, BankType type) {
  const int t = static_cast<int>(type);
#ifdef FREETOKEN_X86
  if (const DotFn int8 = Int8Kernels(tier, type).dot) return int8;
  switch (tier) {
    case IsaTier::kAvx512Bf16:
      return type == BankType::kBF16 ? DotBf16Avx512Bf16 : kAvx512[t];
    case IsaTier::kAvx512F:
      return kAvx512[t];
    case IsaTier::kAvx2Fma:
      return kAvx2[t];
    default:
      break;
  }
#endif
  (void)tier;
  return kScalar[t];
}

DotRowsFn DotRowsFor(IsaTier tier, BankType type) {
#ifdef FREETOKEN_X86
  return Int8Kernels(tier, type).rows;
#else
  (void)tier, (void)type;
  return nullptr;
#endif
}

}  // namespace freetoken
