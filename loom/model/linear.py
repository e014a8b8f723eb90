"""Linear layers y = x W^T as the model runs them: torch's matmul, or Loom's packed CPU kernels.

A model asks its `MatmulBackend` for one `Linear` per weight at load time and calls it in the forward; the backend
decides whether the weight is kept as it is (torch), packed into panels for the C++ kernel (float32 and bfloat16
weights on a CPU with AVX2), or, where the model file stores it in GGUF's Q4_0, Q4_1 or Q8_0 blocks and quantization
is on, kept in those blocks for the quantized kernel. torch's matmul stays the reference: the tests compare them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F

from loom.model.kernels import kernel_for, load_packed_linear, load_quantized_linear
from loom.model.quantized import KERNEL_FORMAT, QuantizedWeight, pack_records

MATMUL_BACKENDS = ("auto", "packed", "torch")
QUANTIZATIONS = ("auto", "gguf", "none")
PANEL_COLUMNS = 16
# bfloat16 panels keep each panel's columns in this order; the kernel widens them to float32 in registers and this
# order puts columns 0-7 and 8-15 in its two registers (see csrc/packed_linear.cpp).
BF16_PANEL_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


class Linear(Protocol):
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class TorchLinear:
    """F.linear; with `cpu_slice_rows`, a CPU weight goes in slices of that many output rows (see `output_head`)."""

    weight: torch.Tensor  # [out_features, in_features]
    bias: torch.Tensor | None = None
    cpu_slice_rows: int | None = None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.cpu_slice_rows
        if rows is None or x.device.type != "cpu" or self.out_features <= rows:
            return F.linear(x, self.weight, self.bias)
        weights = self.weight.split(rows)
        biases = self.bias.split(rows) if self.bias is not None else [None] * len(weights)
        return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def pad_to_panels(bias: torch.Tensor) -> torch.Tensor:
    """[out] -> float32 [16 * ceil(out / 16)], zero-padded: the bias as the kernel adds it, to whole panels."""
    padded = torch.zeros(-(-bias.shape[0] // PANEL_COLUMNS) * PANEL_COLUMNS, dtype=torch.float32)
    padded[: bias.shape[0]] = bias
    return padded


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: panel p holds output columns 16p..16p+15 (zero-padded), k-major."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL_COLUMNS)
    padded = torch.zeros(num_panels * PANEL_COLUMNS, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    panels = padded.view(num_panels, PANEL_COLUMNS, in_features)
    if weight.dtype == torch.bfloat16:
        panels = panels[:, list(BF16_PANEL_ORDER)]
    return panels.transpose(1, 2).contiguous()


@dataclass
class PackedLinear:
    """The weight packed once into 16-column panels for the C++ kernel, which computes in float32.

    The result comes back in the input's dtype: bfloat16 activations and weights are widened exactly, summed in
    float32, the bias added, and rounded once, as torch's bfloat16 matmul does; all inside the one kernel call.
    """

    panels: torch.Tensor
    in_features: int
    out_features: int
    bias: torch.Tensor | None  # float32, padded to whole panels (pad_to_panels)
    kernel: ModuleType

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: ModuleType) -> PackedLinear:
        padded_bias = None if bias is None else pad_to_panels(bias)
        return cls(pack_panels(weight), weight.shape[1], weight.shape[0], padded_bias, kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the forward's packed rows [T, in]: no reshapes (~3 us of Python a call, 120 calls a step)
            return self.kernel.packed_linear(x, self.panels, self.out_features, self.bias)
        y = self.kernel.packed_linear(x.reshape(-1, self.in_features), self.panels, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


@dataclass
class QuantizedLinear:
    """A GGUF Q4_0 / Q4_1 / Q8_0 weight packed once into 16-row panels for the quantized kernel, which dequantizes as
    it goes: float32 activations give the bits that PackedLinear gives on the dequantized weight, from 4.5 (Q4_0), 5
    (Q4_1) or 8.5 (Q8_0) bits a weight read instead of 16 or 32."""

    records: torch.Tensor
    format: str  # the kernel's record layout, "q4_1" or "q8_0" (KERNEL_FORMAT)
    in_features: int
    out_features: int
    bias: torch.Tensor | None  # float32, padded to whole panels (pad_to_panels)
    kernel: ModuleType

    @classmethod
    def pack(cls, weight: QuantizedWeight, bias: torch.Tensor | None, kernel: ModuleType) -> QuantizedLinear:
        padded_bias = None if bias is None else pad_to_panels(bias)
        return cls(pack_records(weight), KERNEL_FORMAT[weight.format], weight.in_features, weight.out_features,
                   padded_bias, kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.kernel.quantized_linear(x, self.records, self.format, self.out_features, self.bias)
        y = self.kernel.quantized_linear(x.reshape(-1, self.in_features), self.records, self.format,
                                         self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


@dataclass
class MatmulBackend:
    """Turns weights into `Linear`s: kept in their GGUF blocks where they come so and the quantized kernel is loaded,
    else packed for the kernel where it is loaded and supports the weight, else torch."""

    kernel: ModuleType | None
    quantized_kernel: ModuleType | None = None

    def supports(self, weight: torch.Tensor) -> bool:
        return (self.kernel is not None and weight.device.type == "cpu"
                and weight.dtype in (torch.float32, torch.bfloat16))

    def runs_quantized(self, weight: torch.Tensor, quantized: QuantizedWeight | None) -> bool:
        return quantized is not None and self.quantized_kernel is not None and weight.device.type == "cpu"

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
               quantized: QuantizedWeight | None = None) -> Linear:
        """`weight` dense (float32 or bfloat16); `quantized`, when the model file has it, the same weight as GGUF
        stores it."""
        if self.runs_quantized(weight, quantized):
            return QuantizedLinear.pack(quantized, bias, self.quantized_kernel)
        if self.supports(weight):
            return PackedLinear.pack(weight, bias, self.kernel)
        return TorchLinear(weight, bias)

    def output_head(self, weight: torch.Tensor, quantized: QuantizedWeight | None = None) -> Linear:
        """The LM head. With torch on CPU it runs in 2048-row slices of the vocabulary, so each slice's weights and
        outputs stay in cache (1.4-1.6x faster at 16-64 rows than one call over SmolLM2's 49,152 rows)."""
        if self.runs_quantized(weight, quantized):
            return QuantizedLinear.pack(quantized, None, self.quantized_kernel)
        if self.supports(weight):
            return PackedLinear.pack(weight, None, self.kernel)
        return TorchLinear(weight, cpu_slice_rows=2048)


def make_matmul(name: str, quantization: str = "none") -> MatmulBackend:
    """'auto': the packed kernel when it builds on this machine, else torch; 'packed' insists on the kernel.
    quantization 'auto': GGUF's blocks run as they are when the quantized kernel builds, 'gguf' insists on it, 'none'
    dequantizes every weight."""
    if name not in MATMUL_BACKENDS:
        raise ValueError(f"unknown matmul backend {name!r}; choose one of {MATMUL_BACKENDS}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    quantized = None
    if quantization != "none":
        quantized = kernel_for("quantization", quantization, "gguf", load_quantized_linear)
    if name == "torch":
        return MatmulBackend(None, quantized)
    return MatmulBackend(kernel_for("matmul_backend", name, "packed", load_packed_linear), quantized)
