"""The int8 KV cache's rows in torch (kv_cache_dtype "int8"): the reference for csrc/int8_kv.h, which gives the same bits.

Each token's K (or V) row of one KV head becomes head_dim int8 codes and one float32 scale, absmax / 127; a value is
code * scale. Per token and head that is head_dim + 4 bytes against bfloat16's 2 * head_dim, so decode attention,
which waits on reading the cache, reads about half as much, and a cache of the same memory holds about twice the
tokens.
"""

from __future__ import annotations

import torch

_INVERSE_127 = torch.tensor(1.0) / 127  # float32, rounded as the kernels' 1.f / 127.f


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> int8 codes [..., head_dim] and float32 scales [...], one per row."""
    x = x.float()
    absmax = x.abs().amax(-1)
    inverse = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, torch.zeros_like(absmax))
    codes = torch.round(x * inverse.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return codes, absmax * _INVERSE_127


def dequantize_heads(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., head_dim] and their scales [...] -> float32 values."""
    return codes.float() * scales.unsqueeze(-1)
