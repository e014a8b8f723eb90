// The int8 KV cache (kv_cache_dtype "int8"): each token's K (or V) row of one KV head is head_dim int8 codes and one
// float32 scale, absmax / 127, so that a value is code * scale. Per token and head: 64 + 4 bytes against bfloat16's
// 128 at a head size of 64, so decode attention, which waits on reading the cache, reads about half as much.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bfloat16.h"

namespace loom {

constexpr float kInverse127 = 1.f / 127.f;

// One head's n values as codes; returns their scale. loom/model/kv_quant.py computes the same bits: inverse =
// 127 / absmax (0 for a row of zeros), code = x * inverse rounded half to even, scale = absmax * (1 / 127).
template <typename T>
inline float quantize_head(const T* x, int64_t n, int8_t* codes) {
  float absmax = 0.f;
  for (int64_t d = 0; d < n; ++d) absmax = std::max(absmax, std::fabs(static_cast<float>(x[d])));
  const float inverse = absmax > 0.f ? 127.f / absmax : 0.f;
  for (int64_t d = 0; d < n; ++d)
    codes[d] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(x[d]) * inverse), -127.f, 127.f));
  return absmax * kInverse127;
}

// A cache value as float32: itself (widened or narrowed), or an int8 code times its scale.
inline float dequantized(float x, float) { return x; }
inline float dequantized(double x, float) { return static_cast<float>(x); }
inline float dequantized(c10::BFloat16 x, float) { return widen(x); }
inline float dequantized(int8_t code, float scale) { return static_cast<float>(code) * scale; }

}  // namespace loom
