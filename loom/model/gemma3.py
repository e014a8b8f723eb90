"""Gemma 3 (text) over a packed row: the embedding scaled by sqrt(hidden), RMSNorm by (1 + weight) before and after
attention and the MLP, RMSNorm on each q and k head, GeGLU (tanh GELU), local layers on a sliding window with their
own RoPE base and global layers on the full context.

Weights arrive under Hugging Face names (and, from a GGUF file, those it stores in blocks Loom's kernels run, once
more as those blocks); q/k/v and gate/up are fused at construction. The numerics follow transformers' Gemma 3 op
for op (norms in float32, RoPE tables computed in float32 then cast), so greedy outputs match; with the fused layer
ops the norms run in one C++ pass each, equal to torch's but for the summation order of their mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.model.attention import AttentionBackend, KVCache
from loom.model.batch_metadata import BatchMetadata
from loom.model.config import ModelConfig
from loom.model.layer_ops import TorchLayerOps
from loom.model.linear import Linear, MatmulBackend, place_in_one_buffer
from loom.model.quantized import QuantizedWeight, take_blocks
from loom.model.rope import rope_table


@dataclass
class Gemma3Layer:
    input_norm: torch.Tensor  # each norm held as (1 + weight), float32
    qkv: Linear  # hidden -> (H + 2*KVH) * D
    qk_norm: torch.Tensor  # [H + KVH, D]: q's head norm for each q head, then k's for each k head
    o: Linear
    post_attention_norm: torch.Tensor
    pre_mlp_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate: gate's rows, then up's
    down: Linear
    post_mlp_norm: torch.Tensor
    window: int | None  # the sliding window of a local layer; None for a global one


class Gemma3Model:
    """Holds the weights (plain tensors, inference only) and runs one step, as LlamaModel does for its family."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 matmul: MatmulBackend, ops: TorchLayerOps, quantized: dict[str, QuantizedWeight] | None = None
                 ) -> None:
        self.config = config
        self.dtype = dtype
        self.ops = ops  # the norms, RoPE and GeGLU's product
        quantized = {} if quantized is None else quantized

        def w(name: str) -> torch.Tensor:
            return weights.pop(name).to(dtype)

        def norm(name: str) -> torch.Tensor:
            return 1.0 + weights.pop(name).float()

        def linear(*names: str) -> Linear:
            dense = w(names[0]) if len(names) == 1 else torch.cat([w(n) for n in names])
            return matmul.linear(dense, None, take_blocks(quantized, names))

        self.embed = w("model.embed_tokens.weight")
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype)
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        head_blocks = quantized.pop(head, None)
        self.lm_head = matmul.output_head(self.embed if config.tie_word_embeddings else w(head), head_blocks)
        self.final_norm = norm("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(Gemma3Layer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                qk_norm=torch.cat([norm(p + "self_attn.q_norm.weight").expand(config.num_heads, -1),
                                   norm(p + "self_attn.k_norm.weight").expand(config.num_kv_heads, -1)]),
                o=linear(p + "self_attn.o_proj.weight"),
                post_attention_norm=norm(p + "post_attention_layernorm.weight"),
                pre_mlp_norm=norm(p + "pre_feedforward_layernorm.weight"),
                gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=linear(p + "mlp.down_proj.weight"),
                post_mlp_norm=norm(p + "post_feedforward_layernorm.weight"),
                window=config.sliding_window if config.sliding_layers[i] else None,
            ))
        place_in_one_buffer(self.layer_linears())
        positions = config.max_position_embeddings
        self.global_rope = rope_table(config.rope_theta, config.head_dim, positions, dtype, config.rope_scaling)
        self.local_rope = rope_table(config.rope_local_theta or config.rope_theta, config.head_dim, positions, dtype)
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.kv_groups = config.kv_cache_groups

    def forward(self, meta: BatchMetadata, kv_caches: list[KVCache], attention: AttentionBackend) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (final norm not yet applied)."""
        cfg = self.config
        eps, heads, kv_heads, d = cfg.norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ropes = {window: tuple(t.index_select(0, meta.positions) for t in table) for window, table in
                 ((None, self.global_rope), (cfg.sliding_window, self.local_rope))}
        norm, add_norm, qk_width = self.ops.gemma_rms_norm, self.ops.gemma_add_rms_norm, (heads + kv_heads) * d
        hidden = self.embed.index_select(0, meta.input_ids) * self.embed_scale
        x = norm(hidden, self.layers[0].input_norm, eps)
        meta_of_layer = {}  # a layer reads and writes its K/V through its KV cache group's block tables
        for g, group in enumerate(self.kv_groups):
            group_meta = meta.for_kv_group(g)
            meta_of_layer.update(dict.fromkeys(group.layers, group_meta))
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            qkv = layer.qkv(x)
            # Each q and k head normed on its own, then all of them rotated: one call each; q, k, v as views.
            qk = norm(qkv[:, :qk_width].view(-1, heads + kv_heads, d), layer.qk_norm, eps).view(-1, qk_width)
            qk = self.ops.rotate_qk(qk, *ropes[layer.window], heads + kv_heads, d)
            q = qk[:, : heads * d].view(-1, heads, d)
            k = qk[:, heads * d :].view(-1, kv_heads, d)
            v = qkv[:, qk_width:].view(-1, kv_heads, d)
            attn = attention(q, k, v, kv_cache, meta_of_layer[i], self.scale, layer.window)
            hidden, x = add_norm(hidden, layer.o(attn), layer.post_attention_norm, layer.pre_mlp_norm, eps)
            delta = layer.down(self.ops.gelu_tanh_mul(layer.gate_up(x)))
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            hidden, x = add_norm(hidden, delta, layer.post_mlp_norm, next_norm, eps)
        return hidden

    def layer_linears(self) -> list[Linear]:
        """Every matmul of the layers, in forward order (for matmul-only timing in benchmarks)."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the selected rows only, in the model's dtype (as LlamaModel.compute_logits gives them)."""
        return self.lm_head(self.ops.gemma_rms_norm(hidden, self.final_norm, self.config.norm_eps))
