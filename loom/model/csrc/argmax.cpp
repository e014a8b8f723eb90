// Greedy sampling's argmax over each row of a step's logits [S, V] (float32, or bfloat16 as a bfloat16 model's LM
// head returns them), V = 49,152 for SmolLM2. torch's argmax is a scalar compare-and-index loop, many times slower
// than a row's maximum alone: here a vector pass finds each row's maximum, then a second finds where it first occurs.
//
// Same answer as torch.argmax: the first index of the maximum, or of the first NaN where a row has one (torch orders
// NaN above every number). NaN is found from the bits: -ffast-math compiles float NaN tests away. bfloat16 logits give
// the answer of their float32 copy, without making that copy: with AVX-512 BW one pass over their bits, 32 a vector
// (row_argmax_bf16); elsewhere widened as they are loaded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bfloat16.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using loom::IVec;
using loom::kLanes;
using loom::load;
using loom::splat;
using loom::Vec;
using loom::vmax;
using loom::widen;

constexpr int32_t kExponentAllOnes = 0x7f800000;  // above it, with the sign cleared: a NaN

// Lanes that hold a NaN (all ones there): the magnitude's bits above the exponent's all-ones pattern.
inline IVec nan_lanes(Vec v) {
  IVec bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7fffffff) > kExponentAllOnes;
}

inline bool any_lane(IVec mask) {
#if defined(__AVX2__)
  return !_mm256_testz_si256(reinterpret_cast<__m256i>(mask), reinterpret_cast<__m256i>(mask));
#else
  int32_t any = 0;
  for (int i = 0; i < kLanes; ++i) any |= mask[i];
  return any != 0;
#endif
}

// Index of the first element of x[0:n] (n >= 1) that `hit` says is the one.
template <typename T, typename Hit>
int64_t first(const T* x, int64_t n, Hit hit) {
  const int64_t whole = n / kLanes * kLanes;
  int64_t i = 0;
  while (i < whole && !any_lane(hit(load(x + i)))) i += kLanes;
  for (; i < n; ++i)
    if (hit(splat(widen(x[i])))[0]) return i;
  return n - 1;  // not reached: the row holds its own maximum
}

// T float or bfloat16 (widened exactly as loaded, so the answer is that of the row's float32 copy).
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  const int64_t whole = n / kLanes * kLanes;
  Vec best = whole > 0 ? load(x) : splat(widen(x[0]));
  IVec nan{};
  for (int64_t i = 0; i < whole; i += kLanes) {
    const Vec v = load(x + i);
    best = vmax(best, v);
    nan |= nan_lanes(v);
  }
  float top = loom::max_lanes(best);
  bool any_nan = any_lane(nan);
  for (int64_t i = whole; i < n; ++i) {
    const float v = widen(x[i]);
    any_nan |= nan_lanes(splat(v))[0] != 0;
    top = v > top ? v : top;
  }
  if (any_nan) return first(x, n, nan_lanes);
  const Vec target = splat(top);
  return first(x, n, [&](Vec v) { return v == target; });
}

#if defined(__AVX512BW__)
// A bfloat16 row's argmax in one pass over its bits, 32 a vector: each value's bits become a 16-bit integer key that
// orders as the values do (the magnitude, negated for a negative value, so -0 and +0 are both 0), NaN above all (every
// NaN the same key, so the first wins). Each of the 32 lanes keeps its highest key and the first vector it came in;
// the row's answer is the lowest index among the lanes that hold the highest. Rows of at most 32 * 32767 values.
inline int64_t row_argmax_bf16(const c10::BFloat16* row, int64_t n) {
  const int16_t* x = reinterpret_cast<const int16_t*>(row);
  const __m512i magnitude_bits = _mm512_set1_epi16(0x7fff), infinity = _mm512_set1_epi16(0x7f80);
  __m512i best = _mm512_set1_epi16(INT16_MIN), best_at = _mm512_setzero_si512();
  for (int64_t i = 0, chunk = 0; i < n; i += 32, ++chunk) {
    const __mmask32 in_row = n - i >= 32 ? ~__mmask32{0} : (__mmask32{1} << (n - i)) - 1;
    const __m512i bits = _mm512_maskz_loadu_epi16(in_row, x + i);
    const __m512i magnitude = _mm512_and_si512(bits, magnitude_bits);
    __m512i key = _mm512_mask_sub_epi16(magnitude, _mm512_movepi16_mask(bits), _mm512_setzero_si512(), magnitude);
    key = _mm512_mask_mov_epi16(key, _mm512_cmpgt_epi16_mask(magnitude, infinity), magnitude_bits);  // NaN: 0x7fff
    key = _mm512_mask_mov_epi16(_mm512_set1_epi16(INT16_MIN), in_row, key);  // past the row: below every value
    const __mmask32 higher = _mm512_cmpgt_epi16_mask(key, best);
    best = _mm512_max_epi16(best, key);
    best_at = _mm512_mask_mov_epi16(best_at, higher, _mm512_set1_epi16(static_cast<int16_t>(chunk)));
  }
  alignas(64) int16_t keys[32], chunks[32];
  _mm512_store_si512(keys, best);
  _mm512_store_si512(chunks, best_at);
  int16_t top = keys[0];
  for (int lane = 1; lane < 32; ++lane) top = keys[lane] > top ? keys[lane] : top;
  int64_t at = n;
  for (int lane = 0; lane < 32; ++lane)
    if (keys[lane] == top) at = std::min<int64_t>(at, int64_t{chunks[lane]} * 32 + lane);
  return at;
}
#endif

}  // namespace

// logits [S, V] float32 or bfloat16 -> [S] int64: each row's greedy token.
torch::Tensor argmax_rows(const torch::Tensor& logits_in) {
  TORCH_CHECK(logits_in.device().is_cpu() && logits_in.dim() == 2 &&
                  (logits_in.scalar_type() == torch::kFloat32 || logits_in.scalar_type() == torch::kBFloat16),
              "logits must be a float32 or bfloat16 [rows, vocab] CPU tensor");
  TORCH_CHECK(logits_in.size(1) > 0, "argmax of an empty row");
  const auto logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto tokens = torch::empty({rows}, logits.options().dtype(torch::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  // Rows split among the threads; a lone row stays on the calling thread (a batch of one wakes no thread).
  loom::by_dtype(logits, "argmax_rows", [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const T* x = logits.data_ptr<T>();
    at::parallel_for(0, rows, 2, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
#if defined(__AVX512BW__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (vocab <= 32 * int64_t{INT16_MAX}) {
            out[r] = row_argmax_bf16(x + r * vocab, vocab);
            continue;
          }
        }
#endif
        out[r] = row_argmax(x + r * vocab, vocab);
      }
    });
  });
  return tokens;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(dim=-1) (CPU, float32 or bfloat16)");
}
