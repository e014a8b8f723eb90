"""One Llama-family layer's weights: what LlamaModel builds and what the C++ layer loop walks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.model.linear import Linear, SiluMulLinear


@dataclass
class LlamaLayer:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (H + 2*KVH) * D
    o: Linear
    post_norm: torch.Tensor
    gate_up: SiluMulLinear  # hidden -> intermediate: SiLU(gate) * up
    down: Linear
    q_norm: torch.Tensor | None = None  # Qwen3's RMSNorm weights of each q and k head, before RoPE
    k_norm: torch.Tensor | None = None
