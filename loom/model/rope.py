"""RoPE tables: cos and sin for every position, computed as transformers computes them (float32 inverse frequencies
times positions, then cast), with the scalings current models use: `linear` (positions divided by a factor) and
`llama3` (Llama 3.1's: low frequencies slowed by the factor, high ones kept, the band between blended)."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(theta: float, head_dim: int, scaling: dict | None = None) -> torch.Tensor:
    """[head_dim / 2] float32: theta^(-2i / head_dim), scaled as `scaling` (a config's rope parameters) says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        slowed = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        blend = (original / wavelength - low) / (high - low)  # 0 at the slow edge of the band, 1 at the fast edge
        blended = (1 - blend) * slowed / factor + blend * slowed
        in_band = ~(wavelength < original / high) * ~(wavelength > original / low)
        return torch.where(in_band, blended, slowed)
    raise ValueError(f"rope scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")


def rope_table(theta: float, head_dim: int, positions: int, dtype: torch.dtype,
               scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim] in `dtype`."""
    inv_freq = inverse_frequencies(theta, head_dim, scaling)
    freqs = torch.arange(positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
