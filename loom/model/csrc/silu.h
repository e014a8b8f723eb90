// SiLU(gate) * up with torch's bits, shared by the fused layer op (layer_ops.cpp) and the AMX matmul that ends in it
// (amx_linear.cpp, a gate/up projection's epilogue); the bfloat16 product goes by a table, which another activation's
// table may take (layer_ops.cpp's bf16_table_mul, for Gemma 3's GeGLU).
#pragma once

#include "bfloat16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace loom {

// SiLU in float32 (silu_float) is a few ulp off torch's: harmless for a float32 result, but for bfloat16 it flips the
// rounding of a value next to a bfloat16 midpoint, so those few (low 16 bits within kNearTie of 0x8000, ~1 in 4000)
// are recomputed in double and rounded once, as torch's float32 result is rounded. Any float32 SiLU within kNearTie
// ulp of the exact one then rounds to torch's bfloat16; the sigmoid in double for all was about 1.6x slower.
constexpr uint32_t kNearTie = 8;

// e^x overflows float32 above ln(FLT_MAX) = 88.7228; torch's x / (1 + inf) is then -0. (Under -ffast-math the
// division by infinity gave NaN: a reciprocal times a Newton step.)
constexpr float kExpOverflow = 88.72f;
// Below this e^x is under 2^-124: 1 + e^x is 1 in float32, so SiLU(-x) = -x exactly, with no subnormals to make.
constexpr float kExpNegligible = -86.f;

// 2^k as a float32, k in [-126, 127].
inline float pow2(int32_t k) {
  const int32_t bits = (k + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e^x * 2^k, for x in [kExpNegligible, kExpOverflow] and k in [-64, 0]: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// Taylor series to r^7 (the remainder under 6e-9 relative), times 2^(n + k) built in the exponent bits; within 2 ulp
// of e^x. Against GCC's vector expf: the same on every libm, and no slower; any e^x a few ulp off gives the same
// bfloat16 SiLU (kNearTie).
inline float exp_times_pow2(float x, int32_t k) {
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860677e-06f;  // ln 2 in two parts: n * hi is exact
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  // 2^(n + k - 1), so that n = 128 (e^88.5) still fits float32's exponent field; then times 2 p, exactly.
  return (p + p) * pow2(static_cast<int32_t>(n) + k - 1);
}

// SiLU in float32 as torch computes it, x / (1 + e^-x), to a few ulp; vectorisable. Where e^-x nears float32's top,
// the reciprocal of 1 + e^-x that -ffast-math divides by would be subnormal, and flushed to 0 (SiLU(-88.5) came out
// -0, torch's is -3.2e-37): there both sides of the division are taken 2^64 smaller, exactly.
inline float silu_float(float x) {
  const float t = std::clamp(-x, kExpNegligible, kExpOverflow);
  const int32_t k = t > 44.f ? -64 : 0;
  const float scale = pow2(k);
  return -x > kExpOverflow ? -0.f : (x * scale) / (scale + exp_times_pow2(t, k));
}

// Whether a float32 SiLU is close enough to a bfloat16 midpoint that its last ulps decide the rounding.
inline bool near_bf16_tie(float silu) {
  uint32_t bits;
  std::memcpy(&bits, &silu, sizeof bits);
  return (bits & 0xffffu) - (0x8000u - kNearTie) <= 2 * kNearTie;
}

// SiLU of x in double, rounded once to float32: for the values near_bf16_tie picks out.
inline float silu_in_double(float x) {
  const double g = x;
  return static_cast<float>(g / (1.0 + std::exp(-g)));
}

// A bfloat16 gate has 65,536 values, so its SiLU rounded to bfloat16 is a table, built once by the arithmetic above
// (same bits): 128 KiB, of which a layer's gates touch a few KiB (|gate| within a few powers of two). Indexed by the
// gate's bits; one entry of padding, so that a 4-byte gather at the last index stays inside. About 1.7x faster than
// computing each SiLU.
inline const uint16_t* bf16_silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 1);
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      c10::BFloat16 gate;
      gate.x = static_cast<uint16_t>(bits);
      float silu = silu_float(widen(gate));
      if (near_bf16_tie(silu)) silu = silu_in_double(widen(gate));
      t[bits] = narrow<c10::BFloat16>(silu).x;
    }
    return t;
  }();
  return table.data();
}

// act(gate) * up for bfloat16 bits, act a table indexed by the gate's bits (bf16_silu_table, or another activation's,
// layer_ops.cpp's bf16_table_mul): the table's value times up (exact in float32), rounded once, as torch rounds it.
inline uint16_t table_mul_bits(const uint16_t* table, uint16_t gate, uint16_t up) {
  c10::BFloat16 act, u;
  act.x = table[gate];
  u.x = up;
  return narrow<c10::BFloat16>(widen(act) * widen(u)).x;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Sixteen lanes of table_mul_bits from the gates' bits zero-extended to 32 (the table indices) and the ups' widened to
// float32: the gate's activation gathered from the table (4 bytes at byte 2 * gate, the low half kept), widened,
// multiplied, rounded to nearest even. The rounding is VCVTNEPS2BF16 where the CPU has it, except for a float32
// denormal product, which it would take as zero where torch keeps it: those go by round_to_bf16's integer steps.
inline __m256i table_mul16(const uint16_t* table, __m512i gate_index, __m512 up) {
  const __m512 act = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(gate_index, table, 2), 16));
  const __m512 product = _mm512_mul_ps(act, up);
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (!_mm512_fpclass_ps_mask(product, 0x20))  // 0x20: denormal
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(product));
#endif
  return round_to_bf16(product);
}

// table_mul16 of sixteen gates' and ups' bfloat16 bits.
inline __m256i table_mul_bits16(const uint16_t* table, __m256i gate, __m256i up) {
  return table_mul16(table, _mm512_cvtepu16_epi32(gate),
                     _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(up), 16)));
}
#endif

// One bfloat16 row's act(gate) * up by the table: gate, up and out as bfloat16 bits.
inline void table_mul_row_bf16(const uint16_t* table, const uint16_t* gate, const uint16_t* up, uint16_t* out,
                               int64_t width) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 16 <= width; i += 16) {
    const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + i));
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(up + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), table_mul_bits16(table, g, u));
  }
#endif
  for (; i < width; ++i) out[i] = table_mul_bits(table, gate[i], up[i]);
}

}  // namespace loom
