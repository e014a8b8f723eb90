// Linear layers y = x W^T on CPU, with W packed once (at model load) into panels of 16 output columns (the tile and
// its order of sums: packed_tile.h). torch's sgemm packs W on every call, which at the 1-64 rows of a decode step
// costs about as much as the FMAs; packed once, the model's matmuls ran 1.3-2.9x faster at 1-256 rows on the
// development machine (AVX2), about even at 2048. bfloat16 weights are widened to float32 in registers, so they cost
// half the memory traffic and run at the float32 rate without AVX-512 BF16 or AMX.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "entry_points.h"
#include "packed_tile.h"

#include <algorithm>
#include <type_traits>

namespace {

using namespace loom::packed;

// x rows of type X, y of X's type. bias: null, or out_features widened to float32 and zero-padded to whole panels.
template <typename X, typename W>
void packed_linear_impl(const X* x, const W* panels, const float* bias, X* y, int64_t rows, int64_t in_features,
                        int64_t out_features) {
  const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
  const int64_t num_full_panels = out_features / kPanel;
  const int64_t panel_size = in_features * kPanel;
  for_each_row_block(x, rows, in_features, [&](int64_t m0, int64_t block_rows, const float* x_block) {
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
            store_edge(edge, n, cols, yi, out_features);
          }
        }
        p += panels_done;
      }
    });
  });
}

}  // namespace

// x [rows, in_features] float32 or bfloat16, panels [ceil(out_features / 16), in_features, 16] float32 or bfloat16
// (see loom/model/linear.py for the layouts), bias float32 [16 * num_panels] or None -> y [rows, out_features] of
// x's dtype.
torch::Tensor packed_linear(const torch::Tensor& x_in, const torch::Tensor& panels, int64_t out_features,
                            const std::optional<torch::Tensor>& bias) {
  check_x(x_in, "packed_linear");
  TORCH_CHECK(panels.device().is_cpu(), "packed_linear runs on CPU");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be a contiguous [num_panels, in_features, 16] tensor");
  TORCH_CHECK(panels.scalar_type() == torch::kFloat32 || panels.scalar_type() == torch::kBFloat16,
              "panels must be float32 or bfloat16");
  TORCH_CHECK(panels.size(1) == x_in.size(1), "x has ", x_in.size(1), " features, the weight expects ",
              panels.size(1));
  TORCH_CHECK(panels.size(0) == (out_features + kPanel - 1) / kPanel, "out_features does not match the panels");
  const float* bias_data = checked_bias(bias, panels.size(0));
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
  m.attr("packed_linear_entry") = loom::entry::export_entry<loom::entry::Matmul>(
      +[](const torch::Tensor& x, const torch::Tensor& w, const std::string&, int64_t out,
          const std::optional<torch::Tensor>& bias) { return packed_linear(x, w, out, bias); });
}
