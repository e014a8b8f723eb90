"""Architecture hyper-parameters, read from a GGUF header or an HF config.json."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one attention kind whose K/V share a block table: a block of the group holds block_size tokens of
    every one of them. `window` is the kind: None for full attention, else the sliding window."""

    layers: tuple[int, ...]
    window: int | None


@dataclass
class ModelConfig:
    """What the forward pass needs to know about a model; `arch` picks llama.py or gpt2.py."""

    arch: str  # "llama" (Llama, Qwen2, Mistral-style), "gemma3" or "gpt2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # rope parameters beyond theta (rope.py): linear, llama3; a Gemma's global layers'
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each q and k head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Gemma 3: local (sliding-window) layers with their own RoPE base, and the attention scale's divisor.
    sliding_window: int | None = None
    sliding_layers: list[bool] = field(default_factory=list)  # per layer: attends within sliding_window only
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gemma3", "gpt2"):
            raise ValueError(f"unsupported architecture {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def kv_cache_groups(self) -> list[KVCacheGroup]:
        """The layers split into groups of one attention kind and one size (full attention first), so that one pool
        of equal blocks serves every group: Gemma 3 270M's 15 local and 3 global layers make 5 + 1 groups of 3.
        A model with one kind has one group of all its layers."""
        kinds: dict[int | None, list[int]] = {}
        for layer in range(self.num_layers):
            window = self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None
            kinds.setdefault(window, []).append(layer)
        size = math.gcd(*(len(layers) for layers in kinds.values()))
        return [KVCacheGroup(tuple(layers[i : i + size]), window)
                for window, layers in sorted(kinds.items(), key=lambda kind: kind[0] is not None)
                for i in range(0, len(layers), size)]

    @property
    def layer_matmul_params(self) -> int:
        """Weights every token multiplies through in the transformer layers (FLOPs = 2x per token)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        mlp = (2 if self.arch == "gpt2" else 3) * h * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def attention_keys_per_token(self) -> float:
        """Keys one query must attend to (QK^T and PV in every layer) to cost its layer matmuls' FLOPs again."""
        return 2 * self.layer_matmul_params / (self.num_layers * 4 * self.num_heads * self.head_dim)

    @property
    def matmul_params_per_token(self) -> int:
        """Weights a sampled token multiplies through (all layers + LM head): FLOPs per token = 2x this."""
        return self.layer_matmul_params + self.lm_head_params
