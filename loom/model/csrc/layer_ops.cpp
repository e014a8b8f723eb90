// A Llama layer's small ops, each fused into one pass over its rows: residual add + RMSNorm, RoPE on q and k in
// place, SiLU(gate) * up; and Gemma 3's RMSNorm, its residual add of a normed output with the next norm, and its
// GeGLU product by a table. torch runs each as a chain of 2-10 ops; at one decode row every op costs its dispatch,
// and at 64 rows every op re-reads its input. bfloat16 results are rounded where torch rounds them (after each op of
// transformers' chain), so they match torch's to the summation order of the norm's mean.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bfloat16.h"
#include "entry_points.h"
#include "silu.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using loom::by_dtype;
using loom::kLanes;
using loom::load;
using loom::narrow;
using loom::rounded;
using loom::store;
using loom::Vec;
using loom::widen;

// Rows per work item: small inputs (a decode step of a few rows) stay on the calling thread.
inline int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

#if defined(__AVX512F__)
// 16 bfloat16 lanes at a time where the CPU has AVX-512: the same operations, each rounded where the scalar code
// rounds it (VCVTNEPS2BF16: nearest even; a float32 denormal rounds to 0), so the same bits but for a norm's float32
// sum of squares, which goes in 16 lanes (a few outputs in 10^5 differ by an ulp from the scalar loop's order). Rows
// of a width that is not a multiple of 16 (heads not of 32) take the scalar code (docs/kernels.md).
namespace wide {

inline __m512 widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

inline __m512 load(const c10::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// x rounded to bfloat16, nearest even, as the bits to store: by VCVTNEPS2BF16 where the CPU has AVX-512 BF16 (a
// float32 denormal becomes 0; one instruction for bfloat16.h's five integer steps), else by those steps.
inline __m256i to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  return loom::round_to_bf16(x);
#endif
}

// x rounded to bfloat16 and widened back.
inline __m512 rounded(__m512 x) { return widen(to_bf16(x)); }

inline void store(c10::BFloat16* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }

// One row: hidden += delta (rounded, in place, when given), then out = weight * rounded(hidden * inv_rms); the
// weight comes widened to float32 once per call.
inline void add_rms_norm_row(c10::BFloat16* hidden, const c10::BFloat16* delta, const float* weight,
                             c10::BFloat16* out, int64_t cols, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; c += 16) {
    __m512 v = load(hidden + c);
    if (delta != nullptr) {
      const __m256i sum = to_bf16(_mm512_add_ps(v, load(delta + c)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hidden + c), sum);
      v = widen(sum);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float sum = _mm512_reduce_add_ps(squares);
  const __m512 inv_rms = _mm512_set1_ps(static_cast<float>(1.0 / std::sqrt(static_cast<double>(sum / cols + eps))));
  for (int64_t c = 0; c < cols; c += 16)
    store(out + c, _mm512_mul_ps(_mm512_loadu_ps(weight + c), rounded(_mm512_mul_ps(load(hidden + c), inv_rms))));
}

// One row's `heads` heads of head_dim (a multiple of 32) rotated in place: x * cos + rotate_half(x) * sin, each
// product rounded, then the sum; the row's cos and sin loaded once for all its heads.
inline void rotate_row(c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin, int64_t heads,
                       int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 c1 = load(cos + i), c2 = load(cos + i + half), s1 = load(sin + i), s2 = load(sin + i + half);
    for (int64_t h = 0; h < heads; ++h) {
      c10::BFloat16* head = x + h * head_dim;
      const __m512 x1 = load(head + i), x2 = load(head + i + half);
      store(head + i, _mm512_sub_ps(rounded(_mm512_mul_ps(x1, c1)), rounded(_mm512_mul_ps(x2, s1))));
      store(head + i + half, _mm512_add_ps(rounded(_mm512_mul_ps(x2, c2)), rounded(_mm512_mul_ps(x1, s2))));
    }
  }
}

}  // namespace wide
#endif

template <typename T>
void add_rms_norm_impl(T* hidden, const T* delta, const T* weight, T* out, int64_t rows, int64_t cols, float eps) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (cols % 16 == 0) {
      std::vector<float> wide_weight(cols);
      for (int64_t c = 0; c < cols; ++c) wide_weight[c] = widen(weight[c]);
      at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          wide::add_rms_norm_row(hidden + r * cols, delta ? delta + r * cols : nullptr, wide_weight.data(),
                                 out + r * cols, cols, eps);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> h(cols);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = hidden + r * cols;
      float squares = 0.f;
      for (int64_t c = 0; c < cols; ++c) {
        float v = widen(hr[c]);
        if (delta != nullptr) {
          v = rounded<T>(v + widen(delta[r * cols + c]));
          hr[c] = narrow<T>(v);
        }
        h[c] = v;
        squares += v * v;
      }
      // In double: -ffast-math would turn a float 1/sqrt into an approximate reciprocal square root.
      const float inv_rms = static_cast<float>(1.0 / std::sqrt(static_cast<double>(squares / cols + eps)));
      T* orow = out + r * cols;
      for (int64_t c = 0; c < cols; ++c) orow[c] = narrow<T>(widen(weight[c]) * rounded<T>(h[c] * inv_rms));
    }
  });
}

// One row's Gemma RMSNorm: in float32, normalized, then times (1 + weight) in float32, rounded once to T at the end
// (transformers' order).
template <typename T>
inline void gemma_norm_row(const T* xr, const float* w, T* o, int64_t cols, float eps) {
  float squares = 0.f;
  for (int64_t c = 0; c < cols; ++c) {
    const float v = widen(xr[c]);
    squares += v * v;
  }
  // In double: -ffast-math would turn a float 1/sqrt into an approximate reciprocal square root.
  const float inv_rms = static_cast<float>(1.0 / std::sqrt(static_cast<double>(squares / cols + eps)));
  for (int64_t c = 0; c < cols; ++c) o[c] = narrow<T>(w[c] * (widen(xr[c]) * inv_rms));
}

// Gemma's RMSNorm of rows [T, G, D] (G heads of a row each normed alone, by weight [G, D]; G = 1 for the hidden
// state).
template <typename T>
void gemma_rms_norm_impl(const T* x, int64_t token_stride, int64_t head_stride, const float* weight, T* out,
                         int64_t tokens, int64_t heads, int64_t cols, float eps) {
  at::parallel_for(0, tokens * heads, grain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      gemma_norm_row(x + (i / heads) * token_stride + (i % heads) * head_stride, weight + (i % heads) * cols,
                     out + i * cols, cols, eps);
  });
}

// Each row: hidden += Gemma's RMSNorm of delta by delta_weight (the norm rounded to T, then the sum, as torch's two
// ops round), then, with a weight, out = Gemma's RMSNorm of the new hidden.
template <typename T>
void gemma_add_rms_norm_impl(T* hidden, const T* delta, const float* delta_weight, const float* weight, T* out,
                             int64_t rows, int64_t cols, float eps) {
  at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<T> normed(cols);
    for (int64_t r = begin; r < end; ++r) {
      T* h = hidden + r * cols;
      gemma_norm_row(delta + r * cols, delta_weight, normed.data(), cols, eps);
      for (int64_t c = 0; c < cols; ++c) h[c] = narrow<T>(widen(h[c]) + widen(normed[c]));
      if (weight != nullptr) gemma_norm_row(h, weight, out + r * cols, cols, eps);
    }
  });
}

// x * cos + rotate_half(x) * sin for one head, rotate_half(x) = (-x2, x1): each product rounded, then the sum.
template <typename T>
inline void rotate_head(T* x, const T* c, const T* s, int64_t half) {
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const Vec x1 = load(x + i), x2 = load(x + i + half);
    store(x + i, rounded<T>(x1 * load(c + i)) - rounded<T>(x2 * load(s + i)));
    store(x + i + half, rounded<T>(x2 * load(c + i + half)) + rounded<T>(x1 * load(s + i + half)));
  }
  for (; i < half; ++i) {
    const float x1 = widen(x[i]), x2 = widen(x[i + half]);
    x[i] = narrow<T>(rounded<T>(x1 * widen(c[i])) - rounded<T>(x2 * widen(s[i])));
    x[i + half] = narrow<T>(rounded<T>(x2 * widen(c[i + half])) + rounded<T>(x1 * widen(s[i + half])));
  }
}

template <typename T>
void rotary_impl(T* qkv, int64_t row_stride, const T* cos, const T* sin, int64_t rows, int64_t heads,
                 int64_t head_dim) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (head_dim % 32 == 0) {
      at::parallel_for(0, rows, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          wide::rotate_row(qkv + r * row_stride, cos + r * head_dim, sin + r * head_dim, heads, head_dim);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, rows, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(qkv + r * row_stride + h * head_dim, cos + r * head_dim, sin + r * head_dim, head_dim / 2);
  });
}

// GCC's -march=native tuning for AVX-512 CPUs vectorises loops 8 lanes wide; this asks for 16 (x86 GCC only: Clang and
// other targets do not know the option).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOOM_WIDE_VECTORS __attribute__((noinline, target("prefer-vector-width=512")))
#else
#define LOOM_WIDE_VECTORS
#endif

// One float32 row's SiLU(gate) * up (bfloat16 rows take silu.h's table). Its cost is its exponentials and divisions,
// so it goes 16 lanes wide.
LOOM_WIDE_VECTORS void silu_mul_row(const float* gate, const float* up, float* out, int64_t width) {
  for (int64_t i = 0; i < width; ++i) out[i] = loom::silu_float(gate[i]) * up[i];
}

// Rows of bfloat16 [gate, up] (each half `width` wide) -> table[gate] * up, by silu.h's table routine.
void table_mul_rows(const uint16_t* table, const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t rows,
                    int64_t width) {
  const auto* bits = reinterpret_cast<const uint16_t*>(gate_up);
  auto* out_bits = reinterpret_cast<uint16_t*>(out);
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      loom::table_mul_row_bf16(table, bits + r * 2 * width, bits + r * 2 * width + width, out_bits + r * width,
                               width);
  });
}

template <typename T>
void silu_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t width) {
  if constexpr (std::is_same_v<T, float>) {
    at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_mul_row(gate_up + r * 2 * width, gate_up + r * 2 * width + width, out + r * width, width);
    });
  } else {
    table_mul_rows(loom::bf16_silu_table(), gate_up, out, rows, width);
  }
}

void check_cpu_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-d CPU tensor");
}

}  // namespace

// hidden [T, C] (+= delta [T, C] in place, when given) -> RMSNorm(hidden) * weight [C] as a new tensor.
torch::Tensor add_rms_norm(torch::Tensor& hidden, const std::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps) {
  check_cpu_rows(hidden, "hidden");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden.size(1) && weight.scalar_type() == hidden.scalar_type(),
              "weight must be [hidden.size(1)] of hidden's dtype");
  if (delta) {
    check_cpu_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == hidden.sizes() && delta->scalar_type() == hidden.scalar_type(),
                "delta must match hidden's shape and dtype");
  }
  auto w = weight.contiguous();
  auto out = torch::empty_like(hidden);
  by_dtype(hidden, "add_rms_norm", [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    add_rms_norm_impl<T>(hidden.data_ptr<T>(), delta ? delta->data_ptr<T>() : nullptr, w.data_ptr<T>(),
                         out.data_ptr<T>(), hidden.size(0), hidden.size(1), static_cast<float>(eps));
  });
  return out;
}

// x [T, D] or [T, G, D] (a row's heads, may be a view with rows and heads apart; each head contiguous), weight float32
// [D] or [G, D] holding (1 + Gemma's weight) -> Gemma's RMSNorm of each row (or head) as a new contiguous tensor.
torch::Tensor gemma_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && (x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
              "x must be a CPU tensor [T, D] or [T, G, D] with its last dimension contiguous");
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1, cols = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.numel() == heads * cols &&
                  weight.size(-1) == cols,
              "weight must be float32 [D] or [G, D] matching x");
  auto w = weight.contiguous();
  auto out = torch::empty(x.sizes(), x.options());
  by_dtype(x, "gemma_rms_norm", [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    gemma_rms_norm_impl<T>(x.data_ptr<T>(), x.stride(0), x.dim() == 3 ? x.stride(1) : 0, w.data_ptr<float>(),
                           out.data_ptr<T>(), x.size(0), heads, cols, static_cast<float>(eps));
  });
  return out;
}

// hidden [T, C] += Gemma's RMSNorm of delta [T, C] by delta_weight, in place (the residual add after a sublayer);
// returns Gemma's RMSNorm of the new hidden by weight (the next sublayer's input), or None without a weight. Weights
// float32 [C] holding (1 + Gemma's weight).
std::optional<torch::Tensor> gemma_add_rms_norm(torch::Tensor& hidden, const torch::Tensor& delta,
                                                const torch::Tensor& delta_weight,
                                                const std::optional<torch::Tensor>& weight, double eps) {
  check_cpu_rows(hidden, "hidden");
  check_cpu_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == hidden.sizes() && delta.scalar_type() == hidden.scalar_type(),
              "delta must match hidden's shape and dtype");
  const int64_t cols = hidden.size(1);
  for (const torch::Tensor* w : {&delta_weight, weight ? &*weight : nullptr}) {
    if (w == nullptr) continue;
    TORCH_CHECK(w->scalar_type() == torch::kFloat32 && w->dim() == 1 && w->size(0) == cols,
                "weights must be float32 [hidden.size(1)]");
  }
  auto dw = delta_weight.contiguous();
  std::optional<torch::Tensor> w, out;
  if (weight) {
    w = weight->contiguous();
    out = torch::empty_like(hidden);
  }
  by_dtype(hidden, "gemma_add_rms_norm", [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    gemma_add_rms_norm_impl<T>(hidden.data_ptr<T>(), delta.data_ptr<T>(), dw.data_ptr<float>(),
                               w ? w->data_ptr<float>() : nullptr, out ? out->data_ptr<T>() : nullptr,
                               hidden.size(0), cols, static_cast<float>(eps));
  });
  return out;
}

// Rotates the first `heads` heads of each row of qkv [T, W] in place; cos, sin [T, head_dim] are the rows' angles.
void rotary_(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
             int64_t head_dim) {
  check_cpu_rows(qkv, "qkv");
  check_cpu_rows(cos, "cos");
  check_cpu_rows(sin, "sin");
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= qkv.size(1), "the rotated heads must fit in a row");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "cos and sin must be [T, head_dim]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "dtype mismatch");
  by_dtype(qkv, "rotary_", [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    rotary_impl<T>(qkv.data_ptr<T>(), qkv.size(1), cos.data_ptr<T>(), sin.data_ptr<T>(), qkv.size(0), heads,
                   head_dim);
  });
}

// gate_up [T, 2I] (gate then up) -> SiLU(gate) * up [T, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_cpu_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up side by side");
  const int64_t width = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), width}, gate_up.options());
  by_dtype(gate_up, "silu_mul", [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    silu_mul_impl<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), gate_up.size(0), width);
  });
  return out;
}

// gate_up [T, 2I] bfloat16 (gate then up), table [65537] bfloat16 (an activation of each bfloat16 value, indexed by
// its bits, one entry of padding) -> table[gate] * up [T, I], rounded once: for an activation that torch computes in
// float32 and rounds to bfloat16, its bits (the table is torch's own output, built once), and torch's product's.
torch::Tensor bf16_table_mul(const torch::Tensor& gate_up, const torch::Tensor& table) {
  check_cpu_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16 && gate_up.size(1) % 2 == 0,
              "gate_up must be bfloat16, gate and up side by side");
  TORCH_CHECK(table.scalar_type() == torch::kBFloat16 && table.dim() == 1 && table.size(0) == 65537 &&
                  table.is_contiguous(),
              "table must be a contiguous bfloat16 [65537]: one entry a bfloat16 value, and one of padding");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  table_mul_rows(reinterpret_cast<const uint16_t*>(table.data_ptr<c10::BFloat16>()),
                 gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, width);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta (in place, if given); returns RMSNorm(hidden) * weight");
  m.def("rotary_", &rotary_, "RoPE on the first heads of each row, in place");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("bf16_table_mul", &bf16_table_mul, "table[gate] * up for bfloat16 gate and up: a tabulated activation's GLU");
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma's RMSNorm by (1 + weight) in float32, of rows or of their heads");
  m.def("gemma_add_rms_norm", &gemma_add_rms_norm,
        "hidden += Gemma's RMSNorm of delta (in place); returns Gemma's RMSNorm of hidden, given a weight");
  m.attr("add_rms_norm_entry") = loom::entry::export_entry<loom::entry::AddRmsNorm>(&add_rms_norm);
  m.attr("rotary_entry") = loom::entry::export_entry<loom::entry::Rotary>(&rotary_);
  m.attr("silu_mul_entry") = loom::entry::export_entry<loom::entry::SiluMul>(&silu_mul);
}
