"""Llama-family forward over a packed row: RMSNorm, RoPE, GQA, SwiGLU; tied or untied head; optional qkv bias (Qwen2).

Weights arrive under Hugging Face names; q/k/v and gate/up are fused at construction so each layer runs
four matmuls, each a `Linear` from the matmul backend. The numerics follow transformers' Llama (fp32 RMSNorm,
rotate_half RoPE) so greedy outputs match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.engine.batch import BatchMetadata
from loom.model.attention import AttentionBackend, KVCache
from loom.model.config import ModelConfig
from loom.model.linear import Linear, MatmulBackend


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers computes it: variance in float32, scaled back to the input dtype before the weight.

    torch's fused `F.rms_norm` gives the same bits as transformers' pow/mean/rsqrt chain here, in one op instead of
    seven: at one decode row, where each op costs its dispatch, 26 instead of 38 us a call (61 calls a step).
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class LlamaLayer:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (H + 2*KVH) * D
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear


class LlamaModel:
    """Holds the weights (plain tensors, inference only) and runs one step."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 matmul: MatmulBackend) -> None:
        self.config = config
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights.pop(name).to(dtype)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = matmul.output_head(self.embed if config.tie_word_embeddings else w("lm_head.weight"))
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
                    qkv=matmul.linear(torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]), bias),
                    o=matmul.linear(w(p + "self_attn.o_proj.weight")),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=matmul.linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                    down=matmul.linear(w(p + "mlp.down_proj.weight")),
                )
            )
        # RoPE table for every position, computed as transformers does (fp32 inv_freq x position).
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(config.max_position_embeddings).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos().to(dtype)
        self.rope_sin = emb.sin().to(dtype)

    def forward(self, meta: BatchMetadata, kv_caches: list[KVCache], attention: AttentionBackend) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (final norm not yet applied)."""
        cfg = self.config
        num_tokens = meta.num_tokens
        h_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        cos = self.rope_cos[meta.positions].unsqueeze(1)
        sin = self.rope_sin[meta.positions].unsqueeze(1)
        scale = cfg.head_dim**-0.5
        hidden = self.embed[meta.input_ids]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = rms_norm(hidden, layer.input_norm, cfg.norm_eps)
            qkv = layer.qkv(x)
            # q and k heads side by side, rotated together: the same arithmetic per element, half the op calls.
            qk = qkv[:, : h_dim + kv_dim].view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            qk = qk * cos + rotate_half(qk) * sin
            v = qkv[:, h_dim + kv_dim :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            attn = attention(q, k, v.contiguous(), kv_cache, meta, scale)
            hidden = hidden + layer.o(attn)
            x = rms_norm(hidden, layer.post_norm, cfg.norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return hidden

    def layer_linears(self) -> list[Linear]:
        """Every matmul of the layers, in forward order (for matmul-only timing in benchmarks)."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the selected rows only (one per sampling request, not every prompt token)."""
        return self.lm_head(rms_norm(hidden, self.final_norm, self.config.norm_eps)).float()
