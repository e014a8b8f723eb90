"""GPT-2 (the article's model) over a packed row: learned positions, LayerNorm, biased attention, tanh-GELU MLP.

Hugging Face stores GPT-2's projections as Conv1D ([in, out]); they are transposed once at construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.model.attention import AttentionBackend, KVCache
from loom.model.batch_metadata import BatchMetadata
from loom.model.config import ModelConfig
from loom.model.linear import Linear, MatmulBackend, place_in_one_buffer


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation, written as transformers writes it so results match bit for bit."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


@dataclass
class GPT2Layer:
    ln1_weight: torch.Tensor
    ln1_bias: torch.Tensor
    qkv: Linear  # hidden -> 3 * hidden
    o: Linear
    ln2_weight: torch.Tensor
    ln2_bias: torch.Tensor
    fc: Linear
    proj: Linear


class GPT2Model:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 matmul: MatmulBackend) -> None:
        self.config = config
        self.dtype = dtype

        def w(name: str, conv1d: bool = False) -> torch.Tensor:
            t = weights.pop("transformer." + name)
            return (t.t().contiguous() if conv1d else t).to(dtype)

        self.wte = w("wte.weight")
        self.lm_head = matmul.output_head(self.wte)  # GPT-2 always ties its output head to the token embedding
        self.wpe = w("wpe.weight")
        self.ln_f_weight, self.ln_f_bias = w("ln_f.weight"), w("ln_f.bias")
        self.layers = [
            GPT2Layer(
                ln1_weight=w(f"h.{i}.ln_1.weight"),
                ln1_bias=w(f"h.{i}.ln_1.bias"),
                qkv=matmul.linear(w(f"h.{i}.attn.c_attn.weight", conv1d=True), w(f"h.{i}.attn.c_attn.bias")),
                o=matmul.linear(w(f"h.{i}.attn.c_proj.weight", conv1d=True), w(f"h.{i}.attn.c_proj.bias")),
                ln2_weight=w(f"h.{i}.ln_2.weight"),
                ln2_bias=w(f"h.{i}.ln_2.bias"),
                fc=matmul.linear(w(f"h.{i}.mlp.c_fc.weight", conv1d=True), w(f"h.{i}.mlp.c_fc.bias")),
                proj=matmul.linear(w(f"h.{i}.mlp.c_proj.weight", conv1d=True), w(f"h.{i}.mlp.c_proj.bias")),
            )
            for i in range(config.num_layers)
        ]
        place_in_one_buffer(self.layer_linears())

    def forward(self, meta: BatchMetadata, kv_caches: list[KVCache], attention: AttentionBackend) -> torch.Tensor:
        cfg = self.config
        num_tokens, hidden_size, heads, d = meta.num_tokens, cfg.hidden_size, cfg.num_heads, cfg.head_dim
        # index_select copies whole rows (indexing copies element by element; see llama.py).
        hidden = self.wte.index_select(0, meta.input_ids) + self.wpe.index_select(0, meta.positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = F.layer_norm(hidden, (hidden_size,), layer.ln1_weight, layer.ln1_bias, cfg.norm_eps)
            q, k, v = layer.qkv(x).split(hidden_size, dim=-1)
            attn = attention(
                q.reshape(num_tokens, heads, d),
                k.reshape(num_tokens, heads, d),
                v.reshape(num_tokens, heads, d),
                kv_cache,
                meta,
                d**-0.5,
            )
            hidden = hidden + layer.o(attn)
            x = F.layer_norm(hidden, (hidden_size,), layer.ln2_weight, layer.ln2_bias, cfg.norm_eps)
            hidden = hidden + layer.proj(gelu_new(layer.fc(x)))
        return hidden

    def layer_linears(self) -> list[Linear]:
        """Every matmul of the layers, in forward order (for matmul-only timing in benchmarks)."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.fc, layer.proj)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as LlamaModel.compute_logits gives them."""
        x = F.layer_norm(hidden, (self.config.hidden_size,), self.ln_f_weight, self.ln_f_bias, self.config.norm_eps)
        return self.lm_head(x)

