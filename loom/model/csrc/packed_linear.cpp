// Linear layers y = x W^T on CPU, with W packed once (at model load) into panels of 16 output columns, each panel
// stored k-major: [in_features][16]. A 6 x 16 tile of y lives in 12 AVX registers while the kernel walks k, reading
// one panel row (16 weights) and broadcasting one x value per row for each step. torch's sgemm packs W on every call
// and, at the 1-64 rows of a decode step, spent more time on that than on the FMAs; packed once, a step's matmuls ran
// 1.6-2.3x faster on the development machine (AVX2). bfloat16 weights are widened to float32 in registers, so they
// cost half the memory traffic and run at nearly the float32 rate even without AVX-512 BF16 or AMX.
//
// Every y element is the FMA chain x[i,0] w[0] + x[i,1] w[1] + ... from zero, in order of k, whatever the number of
// rows and wherever its row sits in the batch: a request's results do not depend on what it is batched with.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the packed linear kernel needs AVX2 and FMA; Loom falls back to torch's matmul"
#endif

namespace {

constexpr int64_t kPanel = 16;      // output columns per panel: two 8-float registers
constexpr int64_t kTileRows = 6;    // 6 x 16 accumulators take 12 of the 16 AVX registers
constexpr int64_t kBlockRows = 96;  // rows of x per block: 96 x in_features floats stay in L2 while all panels pass

// One panel row (the 16 weights of step k) as two float32 registers, columns 0-7 and 8-15.
inline void load_panel_row(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}

// bfloat16 panels store columns in the order 0-3, 8-11, 4-7, 12-15, so that interleaving zeros below each 16-bit
// value (the bfloat16 -> float32 widening) yields columns 0-7 from the low halves of the two 128-bit lanes and 8-15
// from the high halves.
inline void load_panel_row(const at::BFloat16* w, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i zero = _mm256_setzero_si256();
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

// y[0:ROWS, 0:16] = x[0:ROWS, :] . panel. Named accumulators rather than an array: gcc kept an array on the stack
// and stored it every step (46 instead of 104 GFLOP/s at 64 rows).
template <typename W, int ROWS>
void tile(const float* __restrict x, int64_t in_features, const W* __restrict panel, float* __restrict y,
          int64_t y_stride) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero;
  __m256 c30 = zero, c31 = zero, c40 = zero, c41 = zero, c50 = zero, c51 = zero;
  for (int64_t k = 0; k < in_features; ++k) {
    __m256 w0, w1;
    load_panel_row(panel + k * kPanel, w0, w1);
#define LOOM_FMA_ROW(i, lo, hi)                                             \
  if constexpr (ROWS > i) {                                                 \
    const __m256 xi = _mm256_broadcast_ss(x + i * in_features + k);         \
    lo = _mm256_fmadd_ps(xi, w0, lo);                                       \
    hi = _mm256_fmadd_ps(xi, w1, hi);                                       \
  }
    LOOM_FMA_ROW(0, c00, c01)
    LOOM_FMA_ROW(1, c10, c11)
    LOOM_FMA_ROW(2, c20, c21)
    LOOM_FMA_ROW(3, c30, c31)
    LOOM_FMA_ROW(4, c40, c41)
    LOOM_FMA_ROW(5, c50, c51)
#undef LOOM_FMA_ROW
  }
#define LOOM_STORE_ROW(i, lo, hi)                                                              \
  if constexpr (ROWS > i) {                                                                    \
    _mm256_storeu_ps(y + i * y_stride, lo);                                                    \
    _mm256_storeu_ps(y + i * y_stride + 8, hi);                                                \
  }
  LOOM_STORE_ROW(0, c00, c01)
  LOOM_STORE_ROW(1, c10, c11)
  LOOM_STORE_ROW(2, c20, c21)
  LOOM_STORE_ROW(3, c30, c31)
  LOOM_STORE_ROW(4, c40, c41)
  LOOM_STORE_ROW(5, c50, c51)
#undef LOOM_STORE_ROW
}

template <typename W>
void tile_rows(int64_t rows, const float* x, int64_t in_features, const W* panel, float* y, int64_t y_stride) {
  switch (rows) {
    case 6: return tile<W, 6>(x, in_features, panel, y, y_stride);
    case 5: return tile<W, 5>(x, in_features, panel, y, y_stride);
    case 4: return tile<W, 4>(x, in_features, panel, y, y_stride);
    case 3: return tile<W, 3>(x, in_features, panel, y, y_stride);
    case 2: return tile<W, 2>(x, in_features, panel, y, y_stride);
    default: return tile<W, 1>(x, in_features, panel, y, y_stride);
  }
}

template <typename W>
void packed_linear_impl(const float* x, const W* panels, float* y, int64_t rows, int64_t in_features,
                        int64_t out_features) {
  const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
  for (int64_t m0 = 0; m0 < rows; m0 += kBlockRows) {
    const int64_t block_rows = std::min(kBlockRows, rows - m0);
    // Threads split the panels: each weight is read by one thread, once per block of rows.
    at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
      alignas(32) float edge[kTileRows * kPanel];  // the last panel's tile when out_features % 16 != 0
      for (int64_t p = p0; p < p1; ++p) {
        const W* panel = panels + p * in_features * kPanel;
        const int64_t cols = std::min(kPanel, out_features - p * kPanel);
        for (int64_t i = 0; i < block_rows; i += kTileRows) {
          const int64_t tile_rows_n = std::min(kTileRows, block_rows - i);
          const float* xi = x + (m0 + i) * in_features;
          float* yi = y + (m0 + i) * out_features + p * kPanel;
          if (cols == kPanel) {
            tile_rows(tile_rows_n, xi, in_features, panel, yi, out_features);
          } else {
            tile_rows(tile_rows_n, xi, in_features, panel, edge, kPanel);
            for (int64_t r = 0; r < tile_rows_n; ++r)
              std::memcpy(yi + r * out_features, edge + r * kPanel, cols * sizeof(float));
          }
        }
      }
    });
  }
}

}  // namespace

// x [rows, in_features] float32, panels [ceil(out_features / 16), in_features, 16] float32 or bfloat16 (see
// loom/model/linear.py for the layout) -> y [rows, out_features] float32.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "packed_linear runs on CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in_features] tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be a contiguous [num_panels, in_features, 16] tensor");
  TORCH_CHECK(panels.size(1) == x.size(1), "x has ", x.size(1), " features, the weight expects ", panels.size(1));
  TORCH_CHECK(panels.size(0) == (out_features + kPanel - 1) / kPanel, "out_features does not match the panels");
  const int64_t rows = x.size(0), in_features = x.size(1);
  auto y = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  if (panels.scalar_type() == torch::kFloat32) {
    packed_linear_impl(x.data_ptr<float>(), panels.data_ptr<float>(), y.data_ptr<float>(), rows, in_features,
                       out_features);
  } else {
    TORCH_CHECK(panels.scalar_type() == torch::kBFloat16, "panels must be float32 or bfloat16");
    packed_linear_impl(x.data_ptr<float>(), panels.data_ptr<at::BFloat16>(), y.data_ptr<float>(), rows,
                       in_features, out_features);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "x @ W^T with W packed in 16-column panels (CPU, AVX2)");
}
