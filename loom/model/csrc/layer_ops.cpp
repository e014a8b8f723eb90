// A Llama layer's small ops, each fused into one pass over its rows: residual add + RMSNorm, RoPE on q and k in
// place, SiLU(gate) * up. torch runs each as a chain of 3-10 ops; at one decode row every op costs its dispatch, and
// at 64 rows every op re-reads its input. bfloat16 results are rounded where torch rounds them (after each op of
// transformers' chain), so they match torch's to the summation order of the norm's mean.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bfloat16.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

template <typename T>
void add_rms_norm_impl(T* hidden, const T* delta, const T* weight, T* out, int64_t rows, int64_t cols, float eps) {
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
  at::parallel_for(0, rows, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(qkv + r * row_stride + h * head_dim, cos + r * head_dim, sin + r * head_dim, head_dim / 2);
  });
}

// SiLU in float32 (silu_float) is a few ulp off torch's: harmless for a float32 result, but for bfloat16 it flips the
// rounding of a value next to a bfloat16 midpoint, so those few (low 16 bits within kNearTie of 0x8000, ~1 in 4000)
// are recomputed in double and rounded once, as torch's float32 result is rounded. Any float32 SiLU within kNearTie
// ulp of the exact one then rounds to torch's bfloat16. Against the sigmoid in double for all, alternating processes,
// medians of 301 calls at 64 x 1536: bfloat16 60.4-65.5 -> 37.2-38.0 us, float32 43.1-44.5 -> 26.2-28.4 us.
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
// of e^x. Against GCC's vector expf: the same on every libm, and no slower (bfloat16 silu_mul at 64 x 1536,
// alternating builds: 40.5-40.6 against 41.8-47.0 us); any e^x a few ulp off gives the same bfloat16 SiLU (kNearTie).
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

// GCC's -march=native tuning for AVX-512 CPUs vectorises loops 8 lanes wide; this asks for 16 (x86 GCC only: Clang and
// other targets do not know the option).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOOM_WIDE_VECTORS __attribute__((noinline, target("prefer-vector-width=512")))
#else
#define LOOM_WIDE_VECTORS
#endif

// One row's SiLU(gate) * up, `silu` its float32 scratch. Its cost is its exponentials and divisions: 16 lanes wide,
// alternating builds, medians of 201 calls, bfloat16 256 x 1536: 152-155 -> 116-117 us; 64 x 1536: 38 -> 29 us;
// inside a 2048-token prefill 46-50 -> 40-41 ms. Same bits (every bfloat16 gate against torch).
template <typename T>
LOOM_WIDE_VECTORS void silu_mul_row(const T* gate, const T* up, T* out, float* silu, int64_t width) {
  for (int64_t i = 0; i < width; ++i) silu[i] = silu_float(widen(gate[i]));
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t i = 0; i < width; ++i)
      if (near_bf16_tie(silu[i])) silu[i] = silu_in_double(widen(gate[i]));
  }
  for (int64_t i = 0; i < width; ++i) out[i] = narrow<T>(rounded<T>(silu[i]) * widen(up[i]));
}

template <typename T>
void silu_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    std::vector<float> silu(width);
    for (int64_t r = begin; r < end; ++r)
      silu_mul_row(gate_up + r * 2 * width, gate_up + r * 2 * width + width, out + r * width, silu.data(), width);
  });
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta (in place, if given); returns RMSNorm(hidden) * weight");
  m.def("rotary_", &rotary_, "RoPE on the first heads of each row, in place");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
}
