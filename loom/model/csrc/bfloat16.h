// bfloat16 <-> float32, shared by Loom's kernels: a bfloat16 is the high 16 bits of a float32, so widening is exact;
// narrowing rounds to nearest even, as torch does. And the float32-or-bfloat16 dispatch the kernels share.
#pragma once

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loom {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x rounded to nearest even at bfloat16's precision (the high 16 bits of a float32), as the bits to store.
inline uint32_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

#if defined(__AVX512F__)
// bf16_bits for sixteen lanes, before the shift: each lane's bits plus its nearest-even increment, so that the high
// half of each lane is the lane rounded to bfloat16 (the low half is what is left over).
inline __m512i bf16_rounding16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
}

// Sixteen float32 lanes rounded to bfloat16, nearest even, as the bits to store.
inline __m256i round_to_bf16(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounding16(v), 16)); }
#endif

// x stored as a T: unchanged for float, rounded for bfloat16.
template <typename T>
inline T narrow(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    c10::BFloat16 b;
    b.x = static_cast<uint16_t>(bf16_bits(x));
    return b;
  }
}

// x as torch would store it in T, read back as float32: exact for float, rounded for bfloat16.
template <typename T>
inline float rounded(float x) { return widen(narrow<T>(x)); }

// Calls run(static_cast<T*>(nullptr)) with T the element type of t, float or c10::BFloat16; any other dtype is an
// error that names `op`.
template <typename F>
void by_dtype(const torch::Tensor& t, const char* op, F&& run) {
  if (t.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, op, " takes float32 or bfloat16, not ", t.scalar_type());
    run(static_cast<c10::BFloat16*>(nullptr));
  }
}

}  // namespace loom
