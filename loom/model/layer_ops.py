"""A layer's small ops (a Llama's RMSNorm with the residual add, RoPE, SwiGLU's SiLU * up; Gemma 3's RMSNorm and
GeGLU's GELU * up): torch ops, or fused kernels.

`TorchLayerOps` is the reference: transformers' numerics, op for op. `FusedLayerOps` runs each as one pass of Loom's
C++ kernel on CPU tensors (csrc/layer_ops.cpp), rounding bfloat16 where torch rounds it; on other devices it is
the torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import ModuleType

import torch
import torch.nn.functional as F

from loom.config import LAYER_OPS
from loom.model.kernels import kernel_for, load_layer_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers computes it: variance in float32, scaled back to the input dtype before the weight.

    torch's fused `F.rms_norm` gives the same bits as transformers' pow/mean/rsqrt chain here, in one call.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchLayerOps:
    """The ops as torch calls."""

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, RMSNorm of it): the residual stream and the next sublayer's input."""
        if delta is not None:
            hidden = hidden + delta
        return hidden, rms_norm(hidden, weight, eps)

    def rotate_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                  head_dim: int) -> torch.Tensor:
        """qkv [T, W] with its first `heads` heads (q's, then k's) rotated; cos, sin [T, head_dim]."""
        qk = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
        rotated = qk * cos.unsqueeze(1) + rotate_half(qk) * sin.unsqueeze(1)
        return torch.cat((rotated.flatten(1), qkv[:, heads * head_dim :]), dim=1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU's GELU(gate) * up, GELU by its tanh approximation; gate_up [T, 2I] holds gate, then up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def gemma_rms_norm(self, x: torch.Tensor, one_plus_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm over x's last dimension, in float32 and scaled by (1 + weight) before the cast back (Llama
        casts first); x [T, D] with weight [D], or [T, G, D] with weight [G, D] (each of a row's heads alone)."""
        return (F.rms_norm(x.float(), x.shape[-1:], None, eps) * one_plus_weight).to(x.dtype)

    def gemma_add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor, delta_weight: torch.Tensor,
                           weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden + Gemma's RMSNorm of delta by delta_weight, Gemma's RMSNorm of that by weight, or None without
        one): a sublayer's residual add and the next sublayer's input."""
        hidden = hidden + self.gemma_rms_norm(delta, delta_weight, eps)
        return hidden, None if weight is None else self.gemma_rms_norm(hidden, weight, eps)


@dataclass
class FusedLayerOps(TorchLayerOps):
    """One C++ call per op on CPU tensors, in place of torch's chains of 3-10 ops (and their passes over memory)."""

    kernel: ModuleType

    def add_rms_norm(self, hidden, delta, weight, eps):
        if not hidden.is_cpu:
            return super().add_rms_norm(hidden, delta, weight, eps)
        # hidden is the forward's own residual stream (a fresh tensor from the embedding), updated in place.
        return hidden, self.kernel.add_rms_norm(hidden, delta, weight, eps)

    def rotate_qk(self, qkv, cos, sin, heads, head_dim):
        if not qkv.is_cpu:
            return super().rotate_qk(qkv, cos, sin, heads, head_dim)
        self.kernel.rotary_(qkv, cos, sin, heads, head_dim)
        return qkv

    def silu_mul(self, gate_up):
        if not gate_up.is_cpu:
            return super().silu_mul(gate_up)
        return self.kernel.silu_mul(gate_up)

    @cached_property
    def bf16_gelu_tanh_table(self) -> torch.Tensor:
        """torch's bfloat16 GELU (tanh) of every bfloat16 value, indexed by its bits, and one entry of padding: the
        values of torch's vectorized loop, which covers whole rows whose width is a multiple of 64 (its scalar tail
        rounds a few tiny values otherwise)."""
        every_value = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
        return torch.cat([F.gelu(every_value, approximate="tanh"), torch.zeros(1, dtype=torch.bfloat16)])

    def gelu_tanh_mul(self, gate_up):
        # float32's GELU is no table, and a width torch's vector loop does not cover would part from its bits.
        if not gate_up.is_cpu or gate_up.dtype != torch.bfloat16 or gate_up.shape[-1] % 128:
            return super().gelu_tanh_mul(gate_up)
        return self.kernel.bf16_table_mul(gate_up, self.bf16_gelu_tanh_table)

    def gemma_rms_norm(self, x, one_plus_weight, eps):
        if not x.is_cpu:
            return super().gemma_rms_norm(x, one_plus_weight, eps)
        return self.kernel.gemma_rms_norm(x, one_plus_weight, eps)

    def gemma_add_rms_norm(self, hidden, delta, delta_weight, weight, eps):
        if not hidden.is_cpu:
            return super().gemma_add_rms_norm(hidden, delta, delta_weight, weight, eps)
        # hidden is the forward's own residual stream (a fresh tensor from the embedding), updated in place.
        return hidden, self.kernel.gemma_add_rms_norm(hidden, delta, delta_weight, weight, eps)


def make_layer_ops(name: str) -> TorchLayerOps:
    """'auto': the fused kernels when they build on this machine, else torch; 'fused' insists on the kernels."""
    if name not in LAYER_OPS:
        raise ValueError(f"unknown layer ops {name!r}; choose one of {LAYER_OPS}")
    if name == "torch":
        return TorchLayerOps()
    kernel = kernel_for("layer_ops", name, "fused", load_layer_ops)
    return TorchLayerOps() if kernel is None else FusedLayerOps(kernel)
