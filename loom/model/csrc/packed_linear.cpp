// Linear layers y = x W^T on CPU, with W packed once (at model load) into panels of 16 output columns, each panel
// stored k-major: [in_features][16]. A 6 x 16 tile of y lives in 12 AVX registers while the kernel walks k, reading
// one panel row (16 weights) and broadcasting one x value per row for each step. torch's sgemm packs W on every call,
// which at the 1-64 rows of a decode step costs about as much as the FMAs; packed once, the model's matmuls ran
// 1.3-2.9x faster at 1-256 rows on the development machine (AVX2), about even at 2048. bfloat16 weights are widened to
// float32 in registers, so they cost half the memory traffic and run at the float32 rate without AVX-512 BF16 or AMX.
//
// Every y element is the FMA chain x[i,0] w[0] + x[i,1] w[1] + ... from zero, in order of k, whatever the number of
// rows and wherever its row sits in the batch: a row's result does not depend on the rows it is batched with.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bfloat16.h"
#include "vec.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the packed linear kernel needs AVX2 and FMA; Loom falls back to torch's matmul"
#endif

namespace {

constexpr int64_t kPanel = 16;      // output columns per panel: two 8-float registers
constexpr int64_t kTileRows = 6;    // 6 x 16 accumulators take 12 of the 16 AVX registers
constexpr int64_t kBlockBytes = 256 * 1024;  // x rows per block: as many as fit 256 KB, in L2 while all panels pass

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

// Stores 16 results of a row: as they are, or rounded to bfloat16 (nearest even, as loom::narrow).
template <typename Y>
inline void store_row(Y* y, __m256 y0, __m256 y1) {
  loom::store(y, reinterpret_cast<loom::Vec>(y0));
  loom::store(y + 8, reinterpret_cast<loom::Vec>(y1));
}

// y[0:ROWS, 0:16*PANELS] = x[0:ROWS, :] . PANELS adjacent panels (+ bias, when given), all accumulators in registers.
template <typename W, typename Y, int ROWS, int PANELS>
void tile(const float* __restrict x, int64_t in_features, const W* __restrict panel, const float* __restrict bias,
          Y* __restrict y, int64_t y_stride) {
  __m256 acc[ROWS][2 * PANELS];
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * PANELS; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t panel_size = in_features * kPanel;
  for (int64_t k = 0; k < in_features; ++k) {
    __m256 w[2 * PANELS];
#pragma GCC unroll 8
    for (int p = 0; p < PANELS; ++p) load_panel_row(panel + p * panel_size + k * kPanel, w[2 * p], w[2 * p + 1]);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * in_features + k);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * PANELS; ++j) acc[i][j] = _mm256_fmadd_ps(xi, w[j], acc[i][j]);
    }
  }
  // The bias is added to the finished sums, as torch's addmm does.
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * PANELS; ++j)
      if (bias) acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_loadu_ps(bias + j * 8));
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 8
    for (int p = 0; p < PANELS; ++p) store_row(y + i * y_stride + p * kPanel, acc[i][2 * p], acc[i][2 * p + 1]);
}

// A tile of 1-3 rows over one panel has only 2-6 FMA chains, too few to hide the FMA latency and keep loads in
// flight, so such tiles take 3 (one row) or 2 (two or three rows) adjacent panels when that many full panels remain:
// one row went from 7.1 to 9.8 GFLOP/s in float32 (about the VM's memory bandwidth) and 13.4 to 20.1 in bfloat16.
// Returns the number of panels done.
template <typename W, typename Y>
int64_t tile_rows(int64_t rows, int64_t full_panels, const float* x, int64_t in_features, const W* panel,
                  const float* bias, Y* y, int64_t y_stride) {
  switch (rows) {
    case 6: tile<W, Y, 6, 1>(x, in_features, panel, bias, y, y_stride); return 1;
    case 5: tile<W, Y, 5, 1>(x, in_features, panel, bias, y, y_stride); return 1;
    case 4: tile<W, Y, 4, 1>(x, in_features, panel, bias, y, y_stride); return 1;
    case 3:
      if (full_panels >= 2) { tile<W, Y, 3, 2>(x, in_features, panel, bias, y, y_stride); return 2; }
      tile<W, Y, 3, 1>(x, in_features, panel, bias, y, y_stride); return 1;
    case 2:
      if (full_panels >= 2) { tile<W, Y, 2, 2>(x, in_features, panel, bias, y, y_stride); return 2; }
      tile<W, Y, 2, 1>(x, in_features, panel, bias, y, y_stride); return 1;
    default:
      if (full_panels >= 3) { tile<W, Y, 1, 3>(x, in_features, panel, bias, y, y_stride); return 3; }
      tile<W, Y, 1, 1>(x, in_features, panel, bias, y, y_stride); return 1;
  }
}

// x rows of type X, y of X's type. bias: null, or out_features widened to float32 and zero-padded to whole panels.
template <typename X, typename W>
void packed_linear_impl(const X* x, const W* panels, const float* bias, X* y, int64_t rows, int64_t in_features,
                        int64_t out_features) {
  const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
  const int64_t num_full_panels = out_features / kPanel;
  const int64_t panel_size = in_features * kPanel;
  const int64_t rows_per_block =
      std::max<int64_t>(kTileRows, kBlockBytes / (in_features * int64_t{sizeof(float)}) / kTileRows * kTileRows);
  std::vector<float> widened(std::is_same_v<X, float> ? 0 : std::min(rows, rows_per_block) * in_features);
  for (int64_t m0 = 0; m0 < rows; m0 += rows_per_block) {
    const int64_t block_rows = std::min(rows_per_block, rows - m0);
    const float* x_block;
    if constexpr (std::is_same_v<X, float>) {
      x_block = x + m0 * in_features;
    } else {
      const X* from = x + m0 * in_features;
      for (int64_t i = 0; i < block_rows * in_features; ++i) widened[i] = loom::widen(from[i]);
      x_block = widened.data();
    }
    // Threads split the panels: each weight is read by one thread, once per block of rows.
    at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
      alignas(32) float edge[kTileRows * kPanel];  // the last panel's tile when out_features % 16 != 0
      const int64_t full_end = std::min(p1, num_full_panels);
      for (int64_t p = p0; p < p1;) {
        const W* panel = panels + p * panel_size;
        const float* panel_bias = bias ? bias + p * kPanel : nullptr;
        const int64_t cols = std::min(kPanel, out_features - p * kPanel);
        // A block of one tile of rows may cover several full panels at once (see tile_rows).
        const int64_t full_panels = block_rows <= kTileRows ? full_end - p : 1;
        int64_t panels_done = 1;
        for (int64_t i = 0; i < block_rows; i += kTileRows) {
          const int64_t n = std::min(kTileRows, block_rows - i);
          const float* xi = x_block + i * in_features;
          X* yi = y + (m0 + i) * out_features + p * kPanel;
          if (cols == kPanel) {
            panels_done = tile_rows(n, full_panels, xi, in_features, panel, panel_bias, yi, out_features);
          } else {
            tile_rows(n, 0, xi, in_features, panel, panel_bias, edge, kPanel);
            for (int64_t r = 0; r < n; ++r)
              for (int64_t c = 0; c < cols; ++c) yi[r * out_features + c] = loom::narrow<X>(edge[r * kPanel + c]);
          }
        }
        p += panels_done;
      }
    });
  }
}

}  // namespace

// x [rows, in_features] float32 or bfloat16, panels [ceil(out_features / 16), in_features, 16] float32 or bfloat16
// (see loom/model/linear.py for the layouts), bias float32 [16 * num_panels] or None -> y [rows, out_features] of
// x's dtype.
torch::Tensor packed_linear(const torch::Tensor& x_in, const torch::Tensor& panels, int64_t out_features,
                            const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && panels.device().is_cpu(), "packed_linear runs on CPU");
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == torch::kFloat32 || x_in.scalar_type() == torch::kBFloat16),
              "x must be a float32 or bfloat16 [rows, in_features] tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be a contiguous [num_panels, in_features, 16] tensor");
  TORCH_CHECK(panels.scalar_type() == torch::kFloat32 || panels.scalar_type() == torch::kBFloat16,
              "panels must be float32 or bfloat16");
  TORCH_CHECK(panels.size(1) == x_in.size(1), "x has ", x_in.size(1), " features, the weight expects ",
              panels.size(1));
  TORCH_CHECK(panels.size(0) == (out_features + kPanel - 1) / kPanel, "out_features does not match the panels");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == panels.size(0) * kPanel && bias->is_contiguous() &&
                    bias->scalar_type() == torch::kFloat32,
                "bias must be float32, zero-padded to whole panels (see loom/model/linear.py)");
  }
  const float* bias_data = bias ? bias->data_ptr<float>() : nullptr;
  const auto x = x_in.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  auto y = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  loom::by_dtype(x, "packed_linear", [&](auto* x_typed) {
    loom::by_dtype(panels, "packed_linear", [&](auto* panels_typed) {
      using X = std::remove_pointer_t<decltype(x_typed)>;
      using W = std::remove_pointer_t<decltype(panels_typed)>;
      packed_linear_impl<X, W>(x.data_ptr<X>(), panels.data_ptr<W>(), bias_data, y.data_ptr<X>(), rows, in_features,
                               out_features);
    });
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "x @ W^T (+ bias) with W packed in 16-column panels (CPU, AVX2)",
        py::arg("x"), py::arg("panels"), py::arg("out_features"), py::arg("bias") = py::none());
}
