// A Llama model's layers in one call from Python: the forward's loop over its layers, calling Loom's kernels
// directly (its matmuls, the fused layer ops, the paged attention), in the order and with the arguments that
// LlamaModel.forward gives them, so the same bits.
//
// Why: between two kernels of a decode step, Python and torch's entry into the next call run with cold caches (a
// layer streams ~2.2 MB of weights and its K/V through the 2 MiB L2), and each call costs microseconds that a warm
// loop would not see (docs/kernels.md). A batch-1 decode step makes about ten such calls a layer.
//
// The kernels stay in their own modules: each exports its functions' addresses (entry_points.h), which the loop is
// given once, at construction and when the caches are bound, and calls as C++ functions. Any of Loom's matmuls may
// serve a layer (AMX on GGUF records or bfloat16 tiles, the packed or the quantized kernel, in bfloat16 or float32),
// with SwiGLU's SiLU * up in the matmul's epilogue or as the layer ops' silu_mul after it.
#include <torch/extension.h>

#include "entry_points.h"

#include <optional>
#include <string>
#include <vector>

namespace {

namespace entry = loom::entry;

// One matmul as its kernel takes it (loom.model.linear: a Linear's loop_operands()).
struct Matmul {
  entry::Matmul run;
  torch::Tensor weight;
  std::string format;
  int64_t out_features;
  std::optional<torch::Tensor> bias;
  torch::Tensor operator()(const torch::Tensor& x) const { return run(x, weight, format, out_features, bias); }
};

// (entry point, weight, format, out_features, bias) from Python.
Matmul matmul_of(const pybind11::tuple& operands) {
  TORCH_CHECK(operands.size() == 5, "a matmul is (entry point, weight, format, out_features, bias)");
  return {entry::import_entry<entry::Matmul>(operands[0]), operands[1].cast<torch::Tensor>(),
          operands[2].cast<std::string>(), operands[3].cast<int64_t>(),
          operands[4].cast<std::optional<torch::Tensor>>()};
}

struct Layer {
  Matmul qkv, o, gate_up, down;  // gate_up: SiLU(gate) * up in its epilogue, or its product for silu_mul after it
  bool silu_after;
  torch::Tensor input_norm, post_norm;
};

// One KV cache a layer (loom.model.attention.KVCache), bound once for the steps that follow.
struct Cache {
  torch::Tensor k, v;
  std::optional<torch::Tensor> k_scales, v_scales;
};

class LayerLoop {
 public:
  // The layer ops' entry points: add_rms_norm, rotary_, silu_mul.
  LayerLoop(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, const pybind11::object& add_rms_norm,
            const pybind11::object& rotary, const pybind11::object& silu_mul)
      : heads_(heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        add_rms_norm_(entry::import_entry<entry::AddRmsNorm>(add_rms_norm)),
        rotary_(entry::import_entry<entry::Rotary>(rotary)),
        silu_mul_(entry::import_entry<entry::SiluMul>(silu_mul)) {}

  void add_layer(const torch::Tensor& input_norm, const pybind11::tuple& qkv, const pybind11::tuple& o,
                 const torch::Tensor& post_norm, const pybind11::tuple& gate_up, bool silu_after,
                 const pybind11::tuple& down) {
    layers_.push_back(
        {matmul_of(qkv), matmul_of(o), matmul_of(gate_up), matmul_of(down), silu_after, input_norm, post_norm});
  }

  // The layers' KV caches and the attention kernel's attend_step entry point, for the steps that follow.
  void bind(const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v,
            const std::vector<std::optional<torch::Tensor>>& k_scales,
            const std::vector<std::optional<torch::Tensor>>& v_scales, const pybind11::object& attend_step) {
    const size_t n = layers_.size();
    TORCH_CHECK(k.size() == n && v.size() == n && k_scales.size() == n && v_scales.size() == n,
                "one K/V cache a layer");
    attend_step_ = entry::import_entry<entry::AttendStep>(attend_step);
    caches_.clear();
    for (size_t i = 0; i < n; ++i) caches_.push_back({k[i], v[i], k_scales[i], v_scales[i]});
  }

  // hidden [T, hidden] (the residual stream, updated in place until the last layer) and x, its first layer's
  // normed input -> the residual stream after the last layer, as LlamaModel.forward returns it.
  torch::Tensor run(torch::Tensor hidden, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                    const torch::Tensor& context_lens, const torch::Tensor& query_starts, int64_t num_decodes,
                    double scale) {
    TORCH_CHECK(attend_step_ != nullptr && caches_.size() == layers_.size(), "bind the caches first");
    const int64_t n = static_cast<int64_t>(layers_.size()), tokens = x.size(0);
    for (int64_t i = 0; i < n; ++i) {
      const Layer& layer = layers_[i];
      Cache& cache = caches_[i];
      torch::Tensor qkv = layer.qkv(x);
      rotary_(qkv, cos, sin, heads_ + kv_heads_, head_dim_);
      const torch::Tensor heads = qkv.view({tokens, -1, head_dim_});
      const torch::Tensor attn =
          attend_step_(heads.narrow(1, 0, heads_), heads.narrow(1, heads_, kv_heads_),
                       heads.narrow(1, heads_ + kv_heads_, kv_heads_), cache.k, cache.v, cache.k_scales,
                       cache.v_scales, slot_mapping, block_tables, context_lens, query_starts, num_decodes, scale);
      x = add_rms_norm_(hidden, layer.o(attn), layer.post_norm, eps_);
      torch::Tensor gate_up = layer.gate_up(x);
      if (layer.silu_after) gate_up = silu_mul_(gate_up);
      const torch::Tensor delta = layer.down(gate_up);
      if (i + 1 < n)
        x = add_rms_norm_(hidden, delta, layers_[i + 1].input_norm, eps_);
      else
        hidden = hidden + delta;
    }
    return hidden;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  entry::AddRmsNorm add_rms_norm_;
  entry::Rotary rotary_;
  entry::SiluMul silu_mul_;
  entry::AttendStep attend_step_ = nullptr;
  std::vector<Layer> layers_;
  std::vector<Cache> caches_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LayerLoop>(m, "LayerLoop")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, const pybind11::object&, const pybind11::object&,
                          const pybind11::object&>(),
           pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"),
           pybind11::arg("add_rms_norm"), pybind11::arg("rotary"), pybind11::arg("silu_mul"))
      .def("add_layer", &LayerLoop::add_layer)
      .def("bind", &LayerLoop::bind)
      .def("run", &LayerLoop::run);
}
