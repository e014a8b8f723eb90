// The int8 KV cache (kv_cache_dtype "int8"): each token's K (or V) row of one KV head is head_dim int8 codes and one
// float32 scale, absmax / 127, so that a value is code * scale. Per token and head: 64 + 4 bytes against bfloat16's
// 128 at a head size of 64, so decode attention, which waits on reading the cache, reads about half as much.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "bfloat16.h"

namespace loom {

// One head's n values as codes of Code, whose largest value is kMax (127 for the cache's int8 codes, 32767 for the
// int16 queries of paged_attention.cpp's int8 decode); returns their scale. inverse = kMax / absmax (0 for a row of
// zeros), code = x * inverse rounded half to even, scale = absmax * (1 / kMax). For int8 codes
// loom/model/kv_quant.py computes the same bits.
template <typename Code, typename T>
inline float quantize_head(const T* x, int64_t n, Code* codes) {
  constexpr float kMax = std::numeric_limits<Code>::max();
  float absmax = 0.f;
  for (int64_t d = 0; d < n; ++d) absmax = std::max(absmax, std::fabs(static_cast<float>(x[d])));
  const float inverse = absmax > 0.f ? kMax / absmax : 0.f;
  for (int64_t d = 0; d < n; ++d)
    codes[d] = static_cast<Code>(std::clamp(std::nearbyint(static_cast<float>(x[d]) * inverse), -kMax, kMax));
  return absmax * (1.f / kMax);
}

// A cache value as float32: itself (widened or narrowed), or an int8 code times its scale.
inline float dequantized(float x, float) { return x; }
inline float dequantized(double x, float) { return static_cast<float>(x); }
inline float dequantized(c10::BFloat16 x, float) { return widen(x); }
inline float dequantized(int8_t code, float scale) { return static_cast<float>(code) * scale; }

}  // namespace loom
