// Linear layers y = x W^T with W kept in GGUF's quantized blocks (32 weights along k share a float16 scale d, and for
// Q4_1 a float16 offset m): Q4_1 (w = d q + m, q in 0..15, 5 bits a weight) and Q8_0 (w = d q, q in -128..127, 8.5
// bits); Q4_0 comes as Q4_1 with m = -8 d (loom/model/quantized.py). A decode step reads every weight once and does
// little else with it, so at a few rows the time goes mostly to reading weights: 5 bits each instead of bfloat16's 16
// or float32's 32 (at one row the dequantizing now costs about as much as the reading: 7.3 G weights/s from memory on
// one thread here, 10-13 G/s from L2).
//
// Same numbers as the float32 kernel on the dequantized weights, to the bit: d q is exact in float32 (an 11-bit
// significand times a 4- or 8-bit integer), so fma(q, d, m) rounds once, as gguf's dequantize does with d q + m; and
// each y element is then the same FMA chain over k as in packed_tile.h.
//
// Layout (loom/model/quantized.py packs it): per panel of 16 output columns, per block of 32 k, one record:
//   Q4_1:  d[16] float16 | m[16] float16 | 32 x 8 bytes of codes, byte c of step k = col c | col c+8 << 4
//   Q4_1F: d[16] float32 | m[16] float32 | the same codes (Q4_K's blocks: d = d_super sc, m = -dmin_super min, both
//          exact in float32, so fma(q, d, m) is gguf's (d sc) q - dmin min to the bit)
//   Q8_0:  d[16] float16 | 32 x 16 int8 codes, step k's 16 columns in order
//   Q8F:   d[16] float32 (steps 0-15) | d[16] float32 (steps 16-31) | m[16] float32 | Q8_0's codes (Q5_1, Q5_K and
//          Q6_K's blocks: every d q exact in float32, so fma(q, d, m) is gguf's d q + m to the bit)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "entry_points.h"
#include "gguf_records.h"
#include "packed_tile.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#if !defined(__F16C__)
#error "the quantized linear kernel needs F16C; Loom keeps dequantized weights without it"
#endif

namespace {

using namespace loom::packed;

constexpr int64_t kBlock = 32;      // weights along k per GGUF block
constexpr int64_t kFusedRows = 16;  // up to this many rows dequantize in registers (see quantized_linear_impl)

// A record's 16 scales and offsets as float32, columns 0-7 and 8-15.
struct Scales {
  __m256 d0, d1, m0, m1;
};

inline __m256 load_half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

struct Q4_1 {
  static constexpr int64_t kRecordBytes = loom::gguf::kQ4_1RecordBytes;
  static Scales scales(const uint8_t* record) {
    return {load_half8(record), load_half8(record + 16), load_half8(record + 32), load_half8(record + 48)};
  }
  // The 16 weights of step k (0-31) of the record's block.
  static void row(const uint8_t* record, int64_t k, const Scales& s, __m256& w0, __m256& w1) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(record + 64 + 8 * k)));
    const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi32(15));
    const __m256i high = _mm256_srli_epi32(bytes, 4);
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), s.d0, s.m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), s.d1, s.m1);
  }
};

struct Q4_1F {
  static constexpr int64_t kRecordBytes = loom::gguf::kQ4_1FRecordBytes;
  static Scales scales(const uint8_t* record) {
    const float* f = reinterpret_cast<const float*>(record);
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8), _mm256_loadu_ps(f + 16), _mm256_loadu_ps(f + 24)};
  }
  static void row(const uint8_t* record, int64_t k, const Scales& s, __m256& w0, __m256& w1) {
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(record + 128 + 8 * k)));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))), s.d0, s.m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), s.d1, s.m1);
  }
};

struct Q8_0 {
  static constexpr int64_t kRecordBytes = loom::gguf::kQ8_0RecordBytes;
  static Scales scales(const uint8_t* record) {
    return {load_half8(record), load_half8(record + 16), _mm256_setzero_ps(), _mm256_setzero_ps()};
  }
  static void row(const uint8_t* record, int64_t k, const Scales& s, __m256& w0, __m256& w1) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 32 + 16 * k));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), s.d0, s.m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(codes, codes))), s.d1, s.m1);
  }
};

// Q8F's scales: columns 0-7 and 8-15 for steps 0-15 (d) and 16-31 (e), and the offsets.
struct SplitScales {
  __m256 d0, d1, e0, e1, m0, m1;
};

struct Q8F {
  static constexpr int64_t kRecordBytes = loom::gguf::kQ8FRecordBytes;
  static SplitScales scales(const uint8_t* record) {
    const float* f = reinterpret_cast<const float*>(record);
    return {_mm256_loadu_ps(f),      _mm256_loadu_ps(f + 8),  _mm256_loadu_ps(f + 16),
            _mm256_loadu_ps(f + 24), _mm256_loadu_ps(f + 32), _mm256_loadu_ps(f + 40)};
  }
  static void row(const uint8_t* record, int64_t k, const SplitScales& s, __m256& w0, __m256& w1) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 192 + 16 * k));
    const bool first = k < 16;
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), first ? s.d0 : s.e0, s.m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(codes, codes))),
                         first ? s.d1 : s.e1, s.m1);
  }
};

// y[0:ROWS, 0:16*PANELS] = x[0:ROWS, :] . PANELS adjacent quantized panels, each weight dequantized in registers as
// the FMAs need it.
template <typename F, typename Y, int ROWS, int PANELS>
void fused_tile(const float* __restrict x, int64_t in_features, const uint8_t* __restrict panel, int64_t panel_bytes,
                const float* __restrict bias, Y* __restrict y, int64_t y_stride) {
  __m256 acc[ROWS][2 * PANELS];
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * PANELS; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < in_features / kBlock; ++b) {
    const uint8_t* record[PANELS];
    decltype(F::scales(nullptr)) s[PANELS];
#pragma GCC unroll 8
    for (int p = 0; p < PANELS; ++p) {
      record[p] = panel + p * panel_bytes + b * F::kRecordBytes;
      s[p] = F::scales(record[p]);
    }
    const float* xb = x + b * kBlock;
    for (int64_t k = 0; k < kBlock; ++k) {
      __m256 w[2 * PANELS];
#pragma GCC unroll 8
      for (int p = 0; p < PANELS; ++p) F::row(record[p], k, s[p], w[2 * p], w[2 * p + 1]);
#pragma GCC unroll 8
      for (int i = 0; i < ROWS; ++i) {
        const __m256 xi = _mm256_broadcast_ss(xb + i * in_features + k);
#pragma GCC unroll 8
        for (int j = 0; j < 2 * PANELS; ++j) acc[i][j] = _mm256_fmadd_ps(xi, w[j], acc[i][j]);
      }
    }
  }
  finish_tile<Y, ROWS, PANELS>(acc, bias, y, y_stride);
}

// 1-6 rows; one row takes three adjacent panels when `full_panels` allows, for six FMA chains (faster than two
// panels or four). Returns panels done.
template <typename F, typename Y>
int64_t fused_rows(int64_t rows, int64_t full_panels, const float* x, int64_t in_features, const uint8_t* panel,
                   int64_t panel_bytes, const float* bias, Y* y, int64_t y_stride) {
  switch (rows) {
    case 6: fused_tile<F, Y, 6, 1>(x, in_features, panel, panel_bytes, bias, y, y_stride); return 1;
    case 5: fused_tile<F, Y, 5, 1>(x, in_features, panel, panel_bytes, bias, y, y_stride); return 1;
    case 4: fused_tile<F, Y, 4, 1>(x, in_features, panel, panel_bytes, bias, y, y_stride); return 1;
    case 3: fused_tile<F, Y, 3, 1>(x, in_features, panel, panel_bytes, bias, y, y_stride); return 1;
    case 2: fused_tile<F, Y, 2, 1>(x, in_features, panel, panel_bytes, bias, y, y_stride); return 1;
    default:
      if (full_panels >= 3) { fused_tile<F, Y, 1, 3>(x, in_features, panel, panel_bytes, bias, y, y_stride); return 3; }
      if (full_panels >= 2) { fused_tile<F, Y, 1, 2>(x, in_features, panel, panel_bytes, bias, y, y_stride); return 2; }
      fused_tile<F, Y, 1, 1>(x, in_features, panel, panel_bytes, bias, y, y_stride); return 1;
  }
}

// A whole panel dequantized to float32 [in_features][16], the layout of the float32 kernel's panels.
template <typename F>
void dequantize_panel(const uint8_t* panel, int64_t in_features, float* out) {
  for (int64_t b = 0; b < in_features / kBlock; ++b) {
    const uint8_t* record = panel + b * F::kRecordBytes;
    const auto s = F::scales(record);
    for (int64_t k = 0; k < kBlock; ++k) {
      __m256 w0, w1;
      F::row(record, k, s, w0, w1);
      _mm256_storeu_ps(out + (b * kBlock + k) * kPanel, w0);
      _mm256_storeu_ps(out + (b * kBlock + k) * kPanel + 8, w1);
    }
  }
}

// Up to 16 rows: each weight dequantized in registers, once per tile of up to 6 rows (a panel's codes stay in L1 from
// one tile to the next). More rows: each panel dequantized once per block of rows into a float32 scratch (in L2) that
// the float32 tiles reuse for every 6 rows (the two cross near 16 rows).
template <typename F, typename X>
void quantized_linear_impl(const X* x, const uint8_t* records, const float* bias, X* y, int64_t rows,
                           int64_t in_features, int64_t out_features) {
  const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
  const int64_t num_full_panels = out_features / kPanel;
  const int64_t panel_bytes = in_features / kBlock * F::kRecordBytes;
  for_each_row_block(x, rows, in_features, [&](int64_t m0, int64_t block_rows, const float* x_block) {
    const bool fused = block_rows <= kFusedRows;
    at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
      alignas(32) float edge[kTileRows * kPanel];  // the last panel's tile when out_features % 16 != 0
      std::vector<float> dequantized(fused ? 0 : in_features * kPanel);
      const int64_t full_end = std::min(p1, num_full_panels);
      for (int64_t p = p0; p < p1;) {
        const uint8_t* panel = records + p * panel_bytes;
        const float* panel_bias = bias ? bias + p * kPanel : nullptr;
        const int64_t cols = std::min(kPanel, out_features - p * kPanel);
        X* yp = y + m0 * out_features + p * kPanel;
        int64_t panels_done = 1;
        if (fused) {
          // Tiles of at most 6 rows, as even as possible (8 rows: 4 + 4, not 6 + 2); the panel's codes stay in L1.
          const int64_t tiles = (block_rows + kTileRows - 1) / kTileRows;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t i = t * block_rows / tiles, n = (t + 1) * block_rows / tiles - i;
            const float* xi = x_block + i * in_features;
            if (cols == kPanel) {
              panels_done = fused_rows<F>(n, tiles == 1 ? full_end - p : 1, xi, in_features, panel, panel_bytes,
                                          panel_bias, yp + i * out_features, out_features);
            } else {
              fused_rows<F>(n, 0, xi, in_features, panel, panel_bytes, panel_bias, edge, kPanel);
              store_edge(edge, n, cols, yp + i * out_features, out_features);
            }
          }
        } else {
          dequantize_panel<F>(panel, in_features, dequantized.data());
          for (int64_t i = 0; i < block_rows; i += kTileRows) {
            const int64_t n = std::min(kTileRows, block_rows - i);
            const float* xi = x_block + i * in_features;
            if (cols == kPanel) {
              tile_rows(n, 1, xi, in_features, dequantized.data(), panel_bias, yp + i * out_features, out_features);
            } else {
              tile_rows(n, 0, xi, in_features, dequantized.data(), panel_bias, edge, kPanel);
              store_edge(edge, n, cols, yp + i * out_features, out_features);
            }
          }
        }
        p += panels_done;
      }
    });
  });
}

}  // namespace

// x [rows, in_features] float32 or bfloat16; records uint8 [ceil(out_features / 16), in_features / 32, record bytes]
// in `format` "q4_1", "q4_1f", "q8_0" or "q8f" (see the layout above); bias float32 [16 * num_panels] or None -> y [rows,
// out_features] of x's dtype.
torch::Tensor quantized_linear(const torch::Tensor& x_in, const torch::Tensor& records, const std::string& format,
                               int64_t out_features, const std::optional<torch::Tensor>& bias) {
  check_x(x_in, "quantized_linear");
  loom::gguf::check_records(records, format);
  TORCH_CHECK(records.size(1) * kBlock == x_in.size(1), "x has ", x_in.size(1), " features, the weight expects ",
              records.size(1) * kBlock);
  TORCH_CHECK(records.size(0) == (out_features + kPanel - 1) / kPanel, "out_features does not match the records");
  const float* bias_data = checked_bias(bias, records.size(0));
  const auto x = x_in.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  auto y = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  const uint8_t* data = records.data_ptr<uint8_t>();
  loom::by_dtype(x, "quantized_linear", [&](auto* x_typed) {
    using X = std::remove_pointer_t<decltype(x_typed)>;
    if (format == "q4_1") {
      quantized_linear_impl<Q4_1, X>(x.data_ptr<X>(), data, bias_data, y.data_ptr<X>(), rows, in_features,
                                     out_features);
    } else if (format == "q4_1f") {
      quantized_linear_impl<Q4_1F, X>(x.data_ptr<X>(), data, bias_data, y.data_ptr<X>(), rows, in_features,
                                      out_features);
    } else if (format == "q8f") {
      quantized_linear_impl<Q8F, X>(x.data_ptr<X>(), data, bias_data, y.data_ptr<X>(), rows, in_features,
                                    out_features);
    } else {
      quantized_linear_impl<Q8_0, X>(x.data_ptr<X>(), data, bias_data, y.data_ptr<X>(), rows, in_features,
                                     out_features);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_linear", &quantized_linear,
        "x @ W^T (+ bias) with W in GGUF Q4_1 or Q8_0 blocks (Q4_0 as Q4_1, Q4_K as Q4_1F, Q5_1, Q5_K and Q6_K as "
        "Q8F), packed in 16-column panels (CPU, AVX2)",
        py::arg("x"), py::arg("records"), py::arg("format"), py::arg("out_features"), py::arg("bias") = py::none());
  m.attr("quantized_linear_entry") = loom::entry::export_entry<loom::entry::Matmul>(&quantized_linear);
}
