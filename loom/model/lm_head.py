"""The output head: hidden states -> float32 logits over the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_SLICE_ROWS = 2048


def vocab_logits(x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """x [S, hidden] @ lm_head[vocab, hidden]^T in float32.

    On CPU the vocabulary goes in slices of 2048 rows, so each slice's weights and outputs stay in cache: at 16-64
    rows this ran 1.4-1.6x faster than one call over SmolLM2's 49,152 rows on the development machine.
    """
    if x.device.type != "cpu" or lm_head.shape[0] <= CPU_SLICE_ROWS:
        return F.linear(x, lm_head).float()
    return torch.cat([F.linear(x, part) for part in lm_head.split(CPU_SLICE_ROWS)], dim=-1).float()
