// A Llama model's layers in one call from Python: the forward's loop over its layers, calling Loom's kernels
// directly (the AMX matmul, on GGUF records or packed bfloat16 tiles; the fused layer ops; the paged attention), in
// the order and with the arguments that LlamaModel.forward gives them, so the same bits.
//
// Why: between two kernels of a decode step, Python and torch's entry into the next call run with cold caches (a
// layer streams ~2.2 MB of weights and its K/V through the 2 MiB L2), and each call costs microseconds that a warm
// loop would not see: a no-op view of a 1 x 576 tensor took 0.7 us hot and 10 us after a 4 MB torch sum
// (docs/benchmarks.md, fortieth session). A batch-1 decode step makes about ten such calls a layer. This file is
// built into a module of its own together with the kernels' sources (LOOM_LAYER_LOOP leaves their own modules out),
// so that it calls them as C++ functions.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

// Defined in amx_linear.cpp, layer_ops.cpp and paged_attention.cpp.
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features,
                         const std::optional<torch::Tensor>& bias);
torch::Tensor amx_silu_mul_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features,
                                  const std::optional<torch::Tensor>& bias);
torch::Tensor amx_quantized_linear(const torch::Tensor& x, const torch::Tensor& records, const std::string& format,
                                   int64_t out_features, const std::optional<torch::Tensor>& bias, bool gated);
torch::Tensor add_rms_norm(torch::Tensor& hidden, const std::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps);
void rotary_(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t head_dim);
torch::Tensor attend_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          torch::Tensor& k_cache, torch::Tensor& v_cache, const std::optional<torch::Tensor>& k_scales,
                          const std::optional<torch::Tensor>& v_scales, const torch::Tensor& slot_mapping,
                          const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                          const torch::Tensor& query_starts, int64_t num_decodes, double scale);

namespace {

// One matmul on AMX: GGUF records in `format` (loom.model.linear.AmxQuantizedLinear's fields), or, where the
// format is empty, bfloat16 tiles (AmxLinear's panels). Gated: SiLU(gate) * up as the product's epilogue.
struct AmxMatmul {
  torch::Tensor weight;
  std::string format;
  int64_t out_features;
  std::optional<torch::Tensor> bias;
  torch::Tensor operator()(const torch::Tensor& x, bool gated = false) const {
    if (!format.empty()) return amx_quantized_linear(x, weight, format, out_features, bias, gated);
    return gated ? amx_silu_mul_linear(x, weight, out_features, bias) : amx_linear(x, weight, out_features, bias);
  }
};

struct Layer {
  AmxMatmul qkv, o, gate_up, down;  // gate_up: gate and up interleaved, SiLU(gate) * up as its epilogue
  torch::Tensor input_norm, post_norm;
};

// One KV cache a layer (loom.model.attention.KVCache), bound once for the steps that follow.
struct Cache {
  torch::Tensor k, v;
  std::optional<torch::Tensor> k_scales, v_scales;
};

class LayerLoop {
 public:
  LayerLoop(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {}

  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& qkv, const std::string& qkv_format,
                 int64_t qkv_out, const std::optional<torch::Tensor>& qkv_bias, const torch::Tensor& o,
                 const std::string& o_format, int64_t o_out, const torch::Tensor& post_norm,
                 const torch::Tensor& gate_up, const std::string& gate_up_format, int64_t gate_up_out,
                 const torch::Tensor& down, const std::string& down_format, int64_t down_out) {
    layers_.push_back({{qkv, qkv_format, qkv_out, qkv_bias},
                       {o, o_format, o_out, std::nullopt},
                       {gate_up, gate_up_format, gate_up_out, std::nullopt},
                       {down, down_format, down_out, std::nullopt},
                       input_norm,
                       post_norm});
  }

  void bind_caches(const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v,
                   const std::vector<std::optional<torch::Tensor>>& k_scales,
                   const std::vector<std::optional<torch::Tensor>>& v_scales) {
    const size_t n = layers_.size();
    TORCH_CHECK(k.size() == n && v.size() == n && k_scales.size() == n && v_scales.size() == n,
                "one K/V cache a layer");
    caches_.clear();
    for (size_t i = 0; i < n; ++i) caches_.push_back({k[i], v[i], k_scales[i], v_scales[i]});
  }

  // hidden [T, hidden] (the residual stream, updated in place until the last layer) and x, its first layer's
  // normed input -> the residual stream after the last layer, as LlamaModel.forward returns it.
  torch::Tensor run(torch::Tensor hidden, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                    const torch::Tensor& context_lens, const torch::Tensor& query_starts, int64_t num_decodes,
                    double scale) {
    TORCH_CHECK(caches_.size() == layers_.size(), "bind_caches first");
    const int64_t n = static_cast<int64_t>(layers_.size()), tokens = x.size(0);
    for (int64_t i = 0; i < n; ++i) {
      const Layer& layer = layers_[i];
      Cache& cache = caches_[i];
      torch::Tensor qkv = layer.qkv(x);
      rotary_(qkv, cos, sin, heads_ + kv_heads_, head_dim_);
      const torch::Tensor heads = qkv.view({tokens, -1, head_dim_});
      const torch::Tensor attn =
          attend_step(heads.narrow(1, 0, heads_), heads.narrow(1, heads_, kv_heads_),
                      heads.narrow(1, heads_ + kv_heads_, kv_heads_), cache.k, cache.v, cache.k_scales,
                      cache.v_scales, slot_mapping, block_tables, context_lens, query_starts, num_decodes, scale);
      x = add_rms_norm(hidden, layer.o(attn), layer.post_norm, eps_);
      const torch::Tensor delta = layer.down(layer.gate_up(x, /*gated=*/true));
      if (i + 1 < n)
        x = add_rms_norm(hidden, delta, layers_[i + 1].input_norm, eps_);
      else
        hidden = hidden + delta;
    }
    return hidden;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
  std::vector<Cache> caches_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LayerLoop>(m, "LayerLoop")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>(), pybind11::arg("heads"), pybind11::arg("kv_heads"),
           pybind11::arg("head_dim"), pybind11::arg("eps"))
      .def("add_layer", &LayerLoop::add_layer)
      .def("bind_caches", &LayerLoop::bind_caches)
      .def("run", &LayerLoop::run);
}
