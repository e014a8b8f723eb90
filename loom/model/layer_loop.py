"""A Llama model's layers in one C++ call (csrc/layer_loop.cpp), where every layer runs on the kernels that call
takes: the AMX matmul (on GGUF records or bfloat16 tiles), the fused layer ops and the paged attention.

Why: between two kernels of a decode step, Python and torch's entry into the next call run with cold caches (each
layer streams ~2.2 MB of weights and its K/V through the 2 MiB L2), so the ten-odd calls a layer cost microseconds
each. The C++ loop makes the same kernel calls with the same arguments in the same order, so the same bits
(tests/test_layer_loop.py). Steps of more rows than one MLP chunk run the Python loop, which splits the MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from loom.model.attention import AttentionBackend, KVCache, PagedKernelAttention
from loom.model.kernels import load_layer_loop
from loom.model.layer_ops import FusedLayerOps, TorchLayerOps
from loom.model.linear import AmxLinear, AmxQuantizedLinear, AmxQuantizedSiluMulLinear, AmxSiluMulLinear

if TYPE_CHECKING:
    from loom.engine.batch import BatchMetadata
    from loom.model.config import ModelConfig
    from loom.model.llama import LlamaLayer


def amx_weight(linear: AmxLinear | AmxQuantizedLinear) -> tuple[torch.Tensor, str]:
    """A matmul's weight as the loop takes it: GGUF records and their format, or bfloat16 tiles and no format."""
    if isinstance(linear, AmxQuantizedLinear):
        return linear.records, linear.format
    return linear.panels, ""


@dataclass
class LayerLoop:
    """The C++ loop over a model's layers, with the KV caches it was last given."""

    loop: object  # the kernel's LayerLoop
    bound: list[KVCache] | None = None  # the list of caches bound to it (the runner passes the same list each step)

    @classmethod
    def for_layers(cls, layers: list[LlamaLayer], config: ModelConfig, ops: TorchLayerOps) -> LayerLoop | None:
        """The loop where every layer's matmuls run on AMX (biases on q/k/v only) and the layer ops are the fused
        kernels, and the loop's kernel builds here; else None (the forward loops in Python)."""
        amx = (AmxLinear, AmxQuantizedLinear)
        if not isinstance(ops, FusedLayerOps) or not all(
                isinstance(layer.qkv, amx) and isinstance(layer.o, amx) and isinstance(layer.down, amx)
                and isinstance(layer.gate_up, (AmxSiluMulLinear, AmxQuantizedSiluMulLinear))
                and layer.o.bias is None and layer.gate_up.product.bias is None and layer.down.bias is None
                for layer in layers):
            return None
        kernel: ModuleType | None = load_layer_loop()
        if kernel is None:
            return None
        loop = kernel.LayerLoop(config.num_heads, config.num_kv_heads, config.head_dim, config.norm_eps)
        for layer in layers:
            loop.add_layer(layer.input_norm, *amx_weight(layer.qkv), layer.qkv.out_features, layer.qkv.bias,
                           *amx_weight(layer.o), layer.o.out_features, layer.post_norm,
                           *amx_weight(layer.gate_up.product), layer.gate_up.product.out_features,
                           *amx_weight(layer.down), layer.down.out_features)
        return cls(loop)

    @staticmethod
    def runs(attention: AttentionBackend, hidden: torch.Tensor) -> bool:
        """Whether a step's layers can run here: the paged kernel's attention, on CPU."""
        return isinstance(attention, PagedKernelAttention) and hidden.is_cpu

    def __call__(self, hidden: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[KVCache], meta: BatchMetadata, scale: float) -> torch.Tensor:
        """hidden (the residual stream, updated in place) and x (the first layer's normed input) -> the residual
        stream after the last layer, as LlamaModel.forward's own loop returns it."""
        if kv_caches is not self.bound:
            self.loop.bind_caches([c.k for c in kv_caches], [c.v for c in kv_caches],
                                  [c.k_scales for c in kv_caches], [c.v_scales for c in kv_caches])
            self.bound = kv_caches
        return self.loop.run(hidden, x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
                             meta.cu_seqlens_q, meta.num_decodes, scale)
