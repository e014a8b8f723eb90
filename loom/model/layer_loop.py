"""A Llama model's layers in one C++ call (csrc/layer_loop.cpp), where every layer runs on Loom's kernels: its matmuls
(AMX on GGUF records or bfloat16 tiles, the packed or the quantized kernel), the fused layer ops and the paged
attention.

Why: between two kernels of a decode step, Python and torch's entry into the next call run with cold caches (each
layer streams ~2.2 MB of weights and its K/V through the 2 MiB L2), so the ten-odd calls a layer cost microseconds
each. The C++ loop makes the same kernel calls with the same arguments in the same order, so the same bits
(tests/test_layer_loop.py). It calls them through the entry points their modules export (csrc/entry_points.h), so
each kernel is compiled once. Steps of more rows than one MLP chunk run the Python loop, which splits the MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from loom.model.attention import AttentionBackend, KVCache, PagedKernelAttention
from loom.model.kernels import load_layer_loop
from loom.model.layer_ops import FusedLayerOps, TorchLayerOps
from loom.model.linear import Linear, LoopOperands, SiluMulAfter, SiluMulLinear

if TYPE_CHECKING:
    from loom.model.batch_metadata import BatchMetadata
    from loom.model.config import ModelConfig
    from loom.model.llama_layer import LlamaLayer


def operands(linear: Linear | SiluMulLinear) -> LoopOperands | None:
    """A matmul's operands for the loop, or None where it does not run on one of Loom's kernels (torch's matmul)."""
    loop_operands = getattr(linear, "loop_operands", None)
    return None if loop_operands is None else loop_operands()


def gate_up_operands(gate_up: SiluMulLinear, ops: FusedLayerOps) -> tuple[LoopOperands, bool] | None:
    """SwiGLU's gate/up matmul for the loop and whether the layer ops' silu_mul follows it (its epilogue does not
    take SiLU * up); None where the loop cannot run it as the Python loop does."""
    if isinstance(gate_up, SiluMulAfter):
        product = operands(gate_up.product)
        return None if product is None or gate_up.silu_mul != ops.silu_mul else (product, True)
    gated = operands(gate_up)
    return None if gated is None else (gated, False)


@dataclass
class LayerLoop:
    """The C++ loop over a model's layers, with the KV caches and attention kernel it was last given."""

    loop: object  # the kernel's LayerLoop
    # The caches' list (the runner passes the same list each step) and the attention kernel bound to the loop.
    bound: tuple[list[KVCache], ModuleType] | None = None

    @classmethod
    def for_layers(cls, layers: list[LlamaLayer], config: ModelConfig, ops: TorchLayerOps) -> LayerLoop | None:
        """The loop where every layer's matmuls run on Loom's kernels and the layer ops are the fused ones, and the
        loop's own module builds here; else None (the forward loops in Python)."""
        if not isinstance(ops, FusedLayerOps):
            return None
        if any(layer.q_norm is not None for layer in layers):  # the loop has no q/k head norms
            return None
        matmuls = []
        for layer in layers:
            qkv, o, down = operands(layer.qkv), operands(layer.o), operands(layer.down)
            gate_up = gate_up_operands(layer.gate_up, ops)
            if qkv is None or o is None or down is None or gate_up is None:
                return None
            matmuls.append((qkv, o, gate_up, down))
        kernel: ModuleType | None = load_layer_loop()
        if kernel is None:
            return None
        loop = kernel.LayerLoop(config.num_heads, config.num_kv_heads, config.head_dim, config.norm_eps,
                                ops.kernel.add_rms_norm_entry, ops.kernel.rotary_entry, ops.kernel.silu_mul_entry)
        for layer, (qkv, o, (gate_up, silu_after), down) in zip(layers, matmuls):
            loop.add_layer(layer.input_norm, qkv, o, layer.post_norm, gate_up, silu_after, down)
        return cls(loop)

    @staticmethod
    def runs(attention: AttentionBackend, hidden: torch.Tensor) -> bool:
        """Whether a step's layers can run here: the paged kernel's attention, on CPU."""
        return isinstance(attention, PagedKernelAttention) and hidden.is_cpu

    def __call__(self, hidden: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[KVCache], attention: PagedKernelAttention, meta: BatchMetadata,
                 scale: float) -> torch.Tensor:
        """hidden (the residual stream, updated in place) and x (the first layer's normed input) -> the residual
        stream after the last layer, as LlamaModel.forward's own loop returns it."""
        if self.bound is None or self.bound[0] is not kv_caches or self.bound[1] is not attention.kernel:
            self.loop.bind([c.k for c in kv_caches], [c.v for c in kv_caches], [c.k_scales for c in kv_caches],
                           [c.v_scales for c in kv_caches], attention.kernel.attend_step_entry)
            self.bound = (kv_caches, attention.kernel)
        return self.loop.run(hidden, x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
                             meta.cu_seqlens_q, meta.num_decodes, scale)
