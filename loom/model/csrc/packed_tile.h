// The register tile of Loom's packed linear kernels (packed_linear.cpp, quantized_linear.cpp): weights in panels of
// 16 output columns, each panel k-major [in_features][16]; a tile of up to 6 rows x 16 columns of y lives in 12 AVX
// registers while the kernel walks k, reading one panel row (16 weights) and broadcasting one x value per row.
//
// Every y element is the FMA chain x[i,0] w[0] + x[i,1] w[1] + ... from zero, in order of k, whatever the number of
// rows and wherever its row sits in the batch: a row's result does not depend on the rows it is batched with.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include "bfloat16.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the packed linear kernels need AVX2 and FMA; Loom falls back to torch's matmul"
#endif

namespace loom::packed {

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

// Adds the bias (when given) to a tile's finished sums, as torch's addmm does, and stores the tile as Y.
template <typename Y, int ROWS, int PANELS>
inline void finish_tile(__m256 (&acc)[ROWS][2 * PANELS], const float* __restrict bias, Y* __restrict y,
                        int64_t y_stride) {
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
  finish_tile<Y, ROWS, PANELS>(acc, bias, y, y_stride);
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


// The checks both kernels make on x: float32 or bfloat16 [rows, in_features] on CPU; `kernel` names the caller.
inline void check_x(const torch::Tensor& x, const char* kernel) {
  TORCH_CHECK(x.device().is_cpu(), kernel, " runs on CPU");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be a float32 or bfloat16 [rows, in_features] tensor");
}

// The bias as the kernels add it: null, or float32 zero-padded to `num_panels` whole panels.
inline const float* checked_bias(const std::optional<torch::Tensor>& bias, int64_t num_panels) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == num_panels * kPanel && bias->is_contiguous() &&
                  bias->scalar_type() == torch::kFloat32,
              "bias must be float32, zero-padded to whole panels (see loom/model/linear.py)");
  return bias->data_ptr<float>();
}

// Runs `block(m0, block_rows, x_block)` over x's rows in blocks small enough (kBlockBytes of float32) to stay in L2
// while every panel passes over them; x_block is float32, widened from bfloat16 when X is.
template <typename X, typename Block>
void for_each_row_block(const X* x, int64_t rows, int64_t in_features, Block&& block) {
  const int64_t rows_per_block =
      std::max<int64_t>(kTileRows, kBlockBytes / (in_features * int64_t{sizeof(float)}) / kTileRows * kTileRows);
  std::vector<float> widened(std::is_same_v<X, float> ? 0 : std::min(rows, rows_per_block) * in_features);
  for (int64_t m0 = 0; m0 < rows; m0 += rows_per_block) {
    const int64_t block_rows = std::min(rows_per_block, rows - m0);
    if constexpr (std::is_same_v<X, float>) {
      block(m0, block_rows, x + m0 * in_features);
    } else {
      const X* from = x + m0 * in_features;
      for (int64_t i = 0; i < block_rows * in_features; ++i) widened[i] = loom::widen(from[i]);
      block(m0, block_rows, static_cast<const float*>(widened.data()));
    }
  }
}

// Copies the first `cols` columns of a tile computed into a 16-column scratch (the last panel, when out_features is
// not a multiple of 16) to y, stored as Y.
template <typename Y>
void store_edge(const float* edge, int64_t rows, int64_t cols, Y* y, int64_t y_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * y_stride + c] = loom::narrow<Y>(edge[r * kPanel + c]);
}

}  // namespace loom::packed
