"""Llama-family forward over a packed row: RMSNorm, RoPE, GQA, SwiGLU; tied or untied head; optional qkv bias (Qwen2)
and q/k head norms (Qwen3).

Weights arrive under Hugging Face names (and, from a GGUF file, those it stores quantized once more as its blocks);
q/k/v and gate/up are fused at construction so each layer runs four matmuls, each a `Linear` from the matmul
backend. The norms (each with the residual add before it), RoPE and
SwiGLU's SiLU * up come from `ops` (torch's, or Loom's fused kernels); their numerics follow transformers' Llama
(fp32 RMSNorm, rotate_half RoPE) so greedy outputs match. Where every layer runs on Loom's matmul, layer-op and
paged attention kernels, one C++ call runs the loop over the layers (layer_loop.py), with the same bits.
"""

from __future__ import annotations

import torch

from loom.model.attention import AttentionBackend, KVCache
from loom.model.batch_metadata import BatchMetadata
from loom.model.config import ModelConfig
from loom.model.layer_loop import LayerLoop
from loom.model.layer_ops import TorchLayerOps, rms_norm
from loom.model.linear import Linear, MatmulBackend, SiluMulAfter, SiluMulLinear, place_in_one_buffer
from loom.model.llama_layer import LlamaLayer
from loom.model.quantized import QuantizedWeight, take_blocks
from loom.model.rope import rope_table

# A step's MLP runs in chunks of this many rows a thread, so a chunk's gate/up product (256 x 2I: 1.5 MiB for
# SmolLM2) is still in L2 when SiLU x up and then down read it. Chunks change no bit: Loom's matmuls give a row the
# same result in any batch. 128 rows was slower, no chunking about 4% slower on a 2048-token prefill (docs/kernels.md).
MLP_CHUNK_ROWS_PER_THREAD = 256
# Where SiLU x up is the AMX matmul's epilogue, longer chunks: each thread dequantizes a range of panels once for all
# its rows, so longer chunks dequantize and read the weights fewer times (1024 rows: 376 ms against 401 at 256).
AMX_MLP_CHUNK_ROWS_PER_THREAD = 1024


class LlamaModel:
    """Holds the weights (plain tensors, inference only) and runs one step."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 matmul: MatmulBackend, ops: TorchLayerOps,
                 quantized: dict[str, QuantizedWeight] | None = None) -> None:
        self.config = config
        self.dtype = dtype
        self.ops = ops
        quantized = {} if quantized is None else quantized

        def w(name: str) -> torch.Tensor:
            return weights.pop(name).to(dtype)

        def linear(*names: str, bias: torch.Tensor | None = None) -> Linear:
            """The named weights stacked by rows as one Linear; in GGUF blocks when all of them have theirs."""
            dense = w(names[0]) if len(names) == 1 else torch.cat([w(n) for n in names])
            return matmul.linear(dense, bias, take_blocks(quantized, names))

        def silu_mul_linear(gate: str, up: str) -> SiluMulLinear:
            return matmul.silu_mul_linear(w(gate), w(up), None, take_blocks(quantized, (gate, up)), ops.silu_mul)

        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        head_blocks = quantized.pop(head, None)
        self.embed = w("model.embed_tokens.weight")
        self.lm_head = matmul.output_head(self.embed if config.tie_word_embeddings else w(head), head_blocks)
        self.final_norm = w("model.norm.weight")
        self.layers: list[LlamaLayer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                LlamaLayer(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"), bias=bias),
                    o=linear(p + "self_attn.o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=silu_mul_linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=linear(p + "mlp.down_proj.weight"),
                    q_norm=w(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                    k_norm=w(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                )
            )
        self.mlp_chunk_rows_per_thread = (MLP_CHUNK_ROWS_PER_THREAD if any(
            isinstance(layer.gate_up, SiluMulAfter) for layer in self.layers) else AMX_MLP_CHUNK_ROWS_PER_THREAD)
        place_in_one_buffer(self.layer_linears())  # before the layer loop takes the weights
        self.layer_loop = LayerLoop.for_layers(self.layers, config, ops)
        self.rope_cos, self.rope_sin = rope_table(config.rope_theta, config.head_dim, config.max_position_embeddings,
                                                  dtype, config.rope_scaling)

    def forward(self, meta: BatchMetadata, kv_caches: list[KVCache], attention: AttentionBackend) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (final norm not yet applied)."""
        cfg = self.config
        ops = self.ops
        num_tokens = meta.num_tokens
        heads = [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads]  # q, k, v heads side by side in qkv's rows
        # Rows gathered by index_select, which copies whole rows: indexing (self.embed[ids]) copies element by element,
        # 428 -> 161 us for 2048 embedding rows here, 11.3 -> 4.4 us for 64 (cos and sin 54 -> 7 us at 2048).
        cos, sin = self.rope_cos.index_select(0, meta.positions), self.rope_sin.index_select(0, meta.positions)
        scale = cfg.head_dim**-0.5
        embedded = self.embed.index_select(0, meta.input_ids)
        hidden, x = ops.add_rms_norm(embedded, None, self.layers[0].input_norm, cfg.norm_eps)
        if (self.layer_loop is not None and num_tokens <= self.mlp_chunk_rows()
                and self.layer_loop.runs(attention, hidden)):
            return self.layer_loop(hidden, x, cos, sin, kv_caches, attention, meta, scale)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            # q and k heads side by side, rotated together; then q, k, v as views (split_with_sizes: Tensor.split's
            # Python wrapper cost 12 us more a layer in a decode step).
            qkv = layer.qkv(x)
            if layer.q_norm is not None:
                qkv = self.norm_qk(qkv, layer)
            qkv = ops.rotate_qk(qkv, cos, sin, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            q, k, v = qkv.view(num_tokens, -1, cfg.head_dim).split_with_sizes(heads, dim=1)
            attn = attention(q, k, v, kv_cache, meta, scale)
            hidden, x = ops.add_rms_norm(hidden, layer.o(attn), layer.post_norm, cfg.norm_eps)
            delta = self.mlp(layer, x)
            if i + 1 < len(self.layers):
                hidden, x = ops.add_rms_norm(hidden, delta, self.layers[i + 1].input_norm, cfg.norm_eps)
            else:
                hidden = hidden + delta
        return hidden

    def norm_qk(self, qkv: torch.Tensor, layer: LlamaLayer) -> torch.Tensor:
        """qkv [T, W] with each q and k head RMS-normed over head_dim (Qwen3), v as it was: a new tensor."""
        cfg = self.config
        q, k, v = qkv.view(qkv.shape[0], -1, cfg.head_dim).split_with_sizes(
            [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
        q, k = rms_norm(q, layer.q_norm, cfg.norm_eps), rms_norm(k, layer.k_norm, cfg.norm_eps)
        return torch.cat((q, k, v), dim=1).flatten(1)

    def mlp_chunk_rows(self) -> int:
        """Rows of one MLP chunk: mlp_chunk_rows_per_thread on each of torch's threads."""
        return self.mlp_chunk_rows_per_thread * torch.get_num_threads()

    def mlp(self, layer: LlamaLayer, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's down(SiLU(gate) * up) of x [T, hidden], in chunks of mlp_chunk_rows_per_thread rows a thread."""
        chunk_rows = self.mlp_chunk_rows()
        if x.shape[0] <= chunk_rows:  # one chunk: no split, no copy (each op a layer costs µs in a decode step)
            return layer.down(layer.gate_up(x))
        return torch.cat([layer.down(layer.gate_up(rows)) for rows in x.split(chunk_rows)])

    def layer_linears(self) -> list[Linear]:
        """Every matmul of the layers, in forward order (for matmul-only timing in benchmarks)."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up.product, layer.down)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the selected rows only (one per sampling request, not every prompt token), in the model's
        dtype: the sampler makes a float32 copy only for a step that needs one (plain greedy rows do not)."""
        return self.lm_head(self.ops.add_rms_norm(hidden, None, self.final_norm, self.config.norm_eps)[1])
