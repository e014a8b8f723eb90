// Eight float32 lanes as a GCC/Clang vector extension, shared by Loom's attention kernels: it compiles to AVX2 or
// AVX-512 on x86 and to NEON on ARM, with no intrinsics to port.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loom {

constexpr int kLanes = 8;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t UVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// A masked score: finite, since -ffast-math assumes no infinities, and far below exp's range (exp gives 0).
constexpr float kMasked = -1e30f;

inline Vec splat(float x) { return Vec{} + x; }
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }

// kLanes floats from memory with no alignment assumed.
inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kLanes bfloat16s from memory, widened to float32 (exact: a bfloat16 is the high half of a float32). On AVX2 one
// zero-extending load and a shift; GCC splits the generic conversion into two 128-bit halves.
inline Vec load(const c10::BFloat16* p) {
#if defined(__AVX2__)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
#else
  typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Wide __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Half bits;
  std::memcpy(&bits, p, sizeof bits);
  const Wide wide = __builtin_convertvector(bits, Wide) << 16;
  Vec v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
#endif
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// The bits of each lane rounded to nearest even at bfloat16's precision (bf16_bits of bfloat16.h, eight at once),
// still in the high half of each 32-bit lane.
inline UVec bf16_high_bits(Vec x) {
  UVec bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
}

// x rounded to bfloat16 and widened back: what torch's float32 -> bfloat16 -> float32 round trip gives.
inline Vec round_bf16(Vec x) {
  const UVec bits = bf16_high_bits(x);
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// kLanes floats rounded to bfloat16 and stored: the inverse of load(const c10::BFloat16*).
inline void store(c10::BFloat16* p, Vec v) {
  const UVec bits = bf16_high_bits(v) >> 16;
#if defined(__AVX2__)
  const __m256i wide = reinterpret_cast<__m256i>(bits);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
#else
  typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  const Half half = __builtin_convertvector(bits, Half);
  std::memcpy(p, &half, sizeof half);
#endif
}

// x as a T would hold it: unchanged for float, rounded for bfloat16 (narrow then widen, eight lanes at once).
template <typename T>
inline Vec rounded(Vec x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return round_bf16(x);
  }
}

inline float max_lanes(Vec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float sum_lanes(Vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// {sum of a[0]'s lanes, ..., sum of a[7]'s lanes}: eight horizontal sums in 7 adds and 14 shuffles, as a transpose.
inline Vec sum_lanes_of_eight(const Vec* a) {
  auto pairs = [](Vec x, Vec y) {  // {x0+x1, y0+y1, x2+x3, y2+y3, ...}
    return __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  };
  auto quads = [](Vec x, Vec y) {  // from two pairs() results: the four vectors' sums of lanes 0-3, then of 4-7
    return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  const Vec low = quads(pairs(a[0], a[1]), pairs(a[2], a[3]));
  const Vec high = quads(pairs(a[4], a[5]), pairs(a[6], a[7]));
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Sixteen float32 lanes: one AVX-512 register (two AVX2 ones elsewhere), for the kernels that go 16 wide.
typedef float V16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t I16 __attribute__((vector_size(16 * sizeof(int32_t))));

inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bfloat16s widened to float32 (exact): on AVX-512 one zero-extending load and a shift.
inline V16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<V16>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
#else
  typedef uint16_t H16 __attribute__((vector_size(16 * sizeof(uint16_t))));
  typedef uint32_t U16 __attribute__((vector_size(16 * sizeof(uint32_t))));
  H16 bits;
  std::memcpy(&bits, p, sizeof bits);
  const U16 wide = __builtin_convertvector(bits, U16) << 16;
  V16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
#endif
}

inline void store16(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }

inline float sum16(V16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

inline float max16(V16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

// e^x for x <= 0 (scores minus their running max) by Cephes' expf method (x = n ln 2 + f, 2^n e^f with a degree-7
// polynomial); below -87 (masked keys) exactly 0. The kernels' tests hold it to 1e-5 of torch's softmax. V is a
// float vector type and I the int32 vector of as many lanes (Vec and IVec here; 16 lanes in the AVX-512 kernels).
template <typename V, typename I>
inline V exp_nonpositive_lanes(V x) {
  const V clamped = x > -87.f ? x : V{} - 87.f;
  const V n = __builtin_convertvector(__builtin_convertvector(clamped * 1.44269504f - 0.5f, I), V);
  const V f = clamped - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln 2, ln 2 in two parts
  V p = V{} + 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.f;
  const I scale = (__builtin_convertvector(n, I) + 127) << 23;
  V result;
  std::memcpy(&result, &scale, sizeof result);
  result *= p;
  return x < -87.f ? V{} : result;
}

inline Vec exp_nonpositive(Vec x) { return exp_nonpositive_lanes<Vec, IVec>(x); }

}  // namespace loom
