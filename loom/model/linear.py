"""Linear layers y = x W^T as the model runs them: torch's matmul, or Loom's packed CPU kernels.

A model asks its `MatmulBackend` for one `Linear` per weight at load time and calls it in the forward; the backend
decides whether the weight is kept as it is (torch), packed into panels for the C++ kernel (float32 and bfloat16
weights on a CPU with AVX2), or, where the model file stores it in GGUF's Q4_0, Q4_1 or Q8_0 blocks and quantization
is on, kept in those blocks for the quantized kernel. torch's matmul stays the reference: the tests compare them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from loom.config import MATMUL_BACKENDS, QUANTIZATIONS
from loom.model.kernels import kernel_for, load_amx_linear, load_packed_linear, load_quantized_linear
from loom.model.quantized import KERNEL_FORMAT, QuantizedWeight, pack_records

PANEL_COLUMNS = 16
AMX_CHUNK = 32  # k values in one row of an AMX weight tile (64 bytes of bfloat16)
# bfloat16 panels keep each panel's columns in this order; the kernel widens them to float32 in registers and this
# order puts columns 0-7 and 8-15 in its two registers (see csrc/packed_linear.cpp).
BF16_PANEL_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
# A kernel matmul as the C++ layer loop takes it: (the kernel's entry point, a capsule of csrc/entry_points.h's Matmul;
# the weight as packed; its GGUF record format or ""; out_features; the padded float32 bias or None).
LoopOperands = tuple[object, torch.Tensor, str, int, torch.Tensor | None]


class Linear(Protocol):
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class SiluMulLinear(Protocol):
    """SwiGLU's first half, x [rows, in] -> SiLU(x G^T) * (x U^T) [rows, I]; `product` is its matmul alone (gate's and
    up's columns together, in the layout's order), for the benchmarks that time matmuls."""

    product: Linear

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
        if rows is None or not x.is_cpu or self.out_features <= rows:
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

    panels: torch.Tensor  # the weight as the kernel reads it (`layout`)
    in_features: int
    out_features: int
    bias: torch.Tensor | None  # float32, padded to whole panels (pad_to_panels)
    kernel: ModuleType

    @staticmethod
    def layout(weight: torch.Tensor) -> torch.Tensor:
        return pack_panels(weight)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features]."""
        return self.kernel.packed_linear(x, self.panels, self.out_features, self.bias)

    def loop_operands(self) -> LoopOperands:
        """What the C++ layer loop (layer_loop.py) calls this matmul with: the kernel's entry point, as `multiply`."""
        return self.kernel.packed_linear_entry, self.panels, "", self.out_features, self.bias

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: ModuleType) -> PackedLinear:
        padded_bias = None if bias is None else pad_to_panels(bias)
        return cls(cls.layout(weight), weight.shape[1], weight.shape[0], padded_bias, kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the forward's packed rows [T, in]: no reshapes (~3 us of Python a call, 120 calls a step)
            return self.multiply(x)
        return self.multiply(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)


def pack_amx_tiles(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 [out, in] -> [ceil(out / 16), ceil(in / 32), 16, 32], zero-padded: tile (p, c) row r holds, for each
    output column n of panel p, the pair W[16p + n, 32c + 2r], W[16p + n, 32c + 2r + 1] (AMX's layout for TDPBF16PS)."""
    out_features, in_features = weight.shape
    num_panels, num_chunks = -(-out_features // PANEL_COLUMNS), -(-in_features // AMX_CHUNK)
    padded = torch.zeros(num_panels * PANEL_COLUMNS, num_chunks * AMX_CHUNK, dtype=torch.bfloat16)
    padded[:out_features, :in_features] = weight
    pairs = padded.view(num_panels, PANEL_COLUMNS, num_chunks, AMX_CHUNK // 2, 2)  # [p, n, c, r, j]
    return pairs.permute(0, 2, 3, 1, 4).reshape(num_panels, num_chunks, 16, AMX_CHUNK).contiguous()


@dataclass
class AmxLinear(PackedLinear):
    """A bfloat16 weight packed once into AMX tiles (pack_amx_tiles) for the C++ kernel: float32 sums of bfloat16
    products, the bias added, rounded once to bfloat16; every row's result independent of the rows beside it
    (csrc/amx_linear.cpp)."""

    @staticmethod
    def layout(weight: torch.Tensor) -> torch.Tensor:
        return pack_amx_tiles(weight)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.amx_linear(x, self.panels, self.out_features, self.bias)

    def loop_operands(self) -> LoopOperands:
        return self.kernel.amx_linear_entry, self.panels, "", self.out_features, self.bias


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [I, ...] (I a multiple of 8) -> [2I, ...]: rows in groups of 8, gate's then up's, so each 16-column
    panel holds 8 columns of each (what amx_silu_mul_linear's epilogue expects)."""
    groups = gate.shape[0] // (PANEL_COLUMNS // 2)
    return torch.stack([gate.reshape(groups, PANEL_COLUMNS // 2, -1), up.reshape(groups, PANEL_COLUMNS // 2, -1)],
                       dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


@dataclass
class AmxSiluMulLinear:
    """gate and up packed as one AMX weight whose panels hold 8 columns of each (interleave_gate_up), so the kernel
    takes SiLU(gate) * up as it stores each panel: no [rows, 2I] product written and read again, and one call.
    Bit for bit the product rounded to bfloat16 followed by the fused layer op's silu_mul (csrc/silu.h)."""

    product: AmxLinear  # the matmul alone: [rows, 2I], its columns interleaved

    @classmethod
    def pack(cls, gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None, kernel: ModuleType
             ) -> AmxSiluMulLinear:
        """bias: gate's then up's, [2I], or None."""
        if bias is not None:
            bias = interleave_gate_up(*bias.chunk(2))
        return cls(AmxLinear.pack(interleave_gate_up(gate, up), bias, kernel))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, I]."""
        lin = self.product
        return lin.kernel.amx_silu_mul_linear(x, lin.panels, lin.out_features, lin.bias)

    def loop_operands(self) -> LoopOperands:
        lin = self.product
        return lin.kernel.amx_silu_mul_linear_entry, lin.panels, "", lin.out_features, lin.bias


@dataclass
class SiluMulAfter:
    """Any Linear's gate/up product (gate's columns, then up's), then SiLU * up by the layer ops."""

    product: Linear
    silu_mul: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_mul(self.product(x))


@dataclass
class QuantizedLinear:
    """A GGUF Q4_0 / Q4_1 / Q8_0 weight packed once into 16-row panels for the quantized kernel, which dequantizes as
    it goes: float32 activations give the bits that PackedLinear gives on the dequantized weight, from 4.5 (Q4_0), 5
    (Q4_1) or 8.5 (Q8_0) bits a weight read instead of 16 or 32."""

    records: torch.Tensor
    format: str  # the kernel's record layout, "q4_1", "q4_1f", "q8_0" or "q8f" (KERNEL_FORMAT)
    in_features: int
    out_features: int
    bias: torch.Tensor | None  # float32, padded to whole panels (pad_to_panels)
    kernel: ModuleType
    step_pairs: ClassVar[bool] = False  # the records' codes in pairs of steps (pack_records), as the kernel reads them

    @classmethod
    def pack(cls, weight: QuantizedWeight, bias: torch.Tensor | None, kernel: ModuleType) -> QuantizedLinear:
        padded_bias = None if bias is None else pad_to_panels(bias)
        return cls(pack_records(weight, cls.step_pairs), KERNEL_FORMAT[weight.format], weight.in_features,
                   weight.out_features, padded_bias, kernel)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features]."""
        return self.kernel.quantized_linear(x, self.records, self.format, self.out_features, self.bias)

    def loop_operands(self) -> LoopOperands:
        """What the C++ layer loop (layer_loop.py) calls this matmul with: the kernel's entry point, as `multiply`."""
        return self.kernel.quantized_linear_entry, self.records, self.format, self.out_features, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.multiply(x)
        return self.multiply(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)


@dataclass
class AmxQuantizedLinear(QuantizedLinear):
    """GGUF Q4_0 / Q4_1 / Q8_0 records (the quantized kernel's layout, steps in pairs) on AMX: the kernel dequantizes
    each slice of them into bfloat16 tiles in L1 and multiplies those, so a decode step reads 4.5-8.5 bits a weight
    instead of 16. The same bits as AmxLinear on the weight dequantized and rounded to bfloat16
    (csrc/amx_dequantize.h)."""

    step_pairs: ClassVar[bool] = True

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.amx_quantized_linear(x, self.records, self.format, self.out_features, self.bias)

    def loop_operands(self) -> LoopOperands:
        return self.kernel.amx_quantized_linear_entry, self.records, self.format, self.out_features, self.bias


@dataclass
class AmxQuantizedSiluMulLinear:
    """AmxSiluMulLinear with gate and up in GGUF records (rows interleaved in 8s as interleave_gate_up does)."""

    product: AmxQuantizedLinear  # the matmul alone: [rows, 2I], its columns interleaved

    @classmethod
    def pack(cls, blocks: QuantizedWeight, bias: torch.Tensor | None, kernel: ModuleType) -> AmxQuantizedSiluMulLinear:
        """blocks and bias: gate's rows, then up's."""
        gate, up = blocks.blocks.chunk(2)
        interleaved = QuantizedWeight(blocks.format, interleave_gate_up(gate, up))
        if bias is not None:
            bias = interleave_gate_up(*bias.chunk(2))
        return cls(AmxQuantizedLinear.pack(interleaved, bias, kernel))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, I]."""
        lin = self.product
        return lin.kernel.amx_quantized_linear(x, lin.records, lin.format, lin.out_features, lin.bias, True)

    def loop_operands(self) -> LoopOperands:
        lin = self.product
        return lin.kernel.amx_quantized_silu_mul_linear_entry, lin.records, lin.format, lin.out_features, lin.bias


@dataclass
class MatmulBackend:
    """Turns weights into `Linear`s: kept in their GGUF blocks where they come so and blocks are wanted (on AMX tiles
    when `amx_blocks`, else for the quantized kernel), else bfloat16 on AMX tiles where that kernel is loaded, else
    packed for the kernel where it is loaded and supports the weight, else torch."""

    kernel: ModuleType | None
    quantized_kernel: ModuleType | None = None
    amx_kernel: ModuleType | None = None
    amx_blocks: bool = False  # bfloat16 weights in GGUF blocks run on AMX (amx_quantized_linear)

    def runs_amx(self, weight: torch.Tensor) -> bool:
        return self.amx_kernel is not None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16

    def supports(self, weight: torch.Tensor) -> bool:
        return (self.kernel is not None and weight.device.type == "cpu"
                and weight.dtype in (torch.float32, torch.bfloat16))

    def runs_blocks_on_amx(self, weight: torch.Tensor, quantized: QuantizedWeight | None) -> bool:
        """The AMX kernel reads every record layout (KERNEL_FORMAT) the quantized kernel does."""
        return quantized is not None and self.amx_blocks and self.runs_amx(weight)

    def runs_quantized(self, weight: torch.Tensor, quantized: QuantizedWeight | None) -> bool:
        return quantized is not None and self.quantized_kernel is not None and weight.device.type == "cpu"

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
               quantized: QuantizedWeight | None = None) -> Linear:
        """`weight` dense (float32 or bfloat16); `quantized`, when the model file has it, the same weight as GGUF
        stores it."""
        if self.runs_blocks_on_amx(weight, quantized):
            return AmxQuantizedLinear.pack(quantized, bias, self.amx_kernel)
        if self.runs_quantized(weight, quantized):
            return QuantizedLinear.pack(quantized, bias, self.quantized_kernel)
        if self.runs_amx(weight):
            return AmxLinear.pack(weight, bias, self.amx_kernel)
        if self.supports(weight):
            return PackedLinear.pack(weight, bias, self.kernel)
        return TorchLinear(weight, bias)

    def silu_mul_linear(self, gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None,
                        quantized: QuantizedWeight | None, silu_mul: Callable[[torch.Tensor], torch.Tensor]
                        ) -> SiluMulLinear:
        """SwiGLU's gate and up projections as one matmul: SiLU * up in the AMX kernel's epilogue where AMX runs them,
        else `silu_mul` after `linear`'s product. bias and quantized: gate's rows, then up's."""
        if self.runs_amx(gate) and gate.shape[0] % 8 == 0:
            if self.runs_blocks_on_amx(gate, quantized):
                return AmxQuantizedSiluMulLinear.pack(quantized, bias, self.amx_kernel)
            if not self.runs_quantized(gate, quantized):
                return AmxSiluMulLinear.pack(gate, up, bias, self.amx_kernel)
        return SiluMulAfter(self.linear(torch.cat([gate, up]), bias, quantized), silu_mul)

    def output_head(self, weight: torch.Tensor, quantized: QuantizedWeight | None = None) -> Linear:
        """The LM head. With torch on CPU it runs in 2048-row slices of the vocabulary, so each slice's weights and
        outputs stay in cache (1.4-1.6x faster at 16-64 rows than one call over SmolLM2's 49,152 rows)."""
        if self.runs_blocks_on_amx(weight, quantized):
            return AmxQuantizedLinear.pack(quantized, None, self.amx_kernel)
        if self.runs_quantized(weight, quantized):
            return QuantizedLinear.pack(quantized, None, self.quantized_kernel)
        if self.runs_amx(weight):
            return AmxLinear.pack(weight, None, self.amx_kernel)
        if self.supports(weight):
            return PackedLinear.pack(weight, None, self.kernel)
        return TorchLinear(weight, cpu_slice_rows=2048)


WEIGHT_FIELDS = ("panels", "records", "weight")  # the tensor a Linear's matmul streams, by the Linear's kind
PAGE_BYTES = 4096


def place_in_one_buffer(linears: list[Linear]) -> None:
    """Moves the CPU weights of `linears` into one buffer, in the order given (a forward's), each at a page boundary.

    Why: a decode step reads each small matmul's weights from memory once, and those read as separate allocations
    came ~2x slower than the same bytes as one run (a Gemma 3 270M gate/up projection after the caches were
    flushed: 0.44-0.68 ms against 0.24); decode steps ran 3-4% faster. The values and every kernel's bits stay
    the same: only where the bytes live changes."""
    fields = []
    for linear in linears:
        owner = getattr(linear, "product", linear)  # a gate/up pair's matmul
        for name in WEIGHT_FIELDS:
            tensor = getattr(owner, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.is_cpu and tensor.is_contiguous():
                fields.append((owner, name, tensor))
    if not fields:
        return
    spans = [-(-t.nbytes // PAGE_BYTES) * PAGE_BYTES for _, _, t in fields]
    buffer = torch.empty(sum(spans) + PAGE_BYTES, dtype=torch.uint8)
    offset = -buffer.data_ptr() % PAGE_BYTES
    for (owner, name, tensor), span in zip(fields, spans):
        placed = buffer[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        placed.copy_(tensor)
        setattr(owner, name, placed)
        offset += span


def make_matmul(name: str, quantization: str = "none", dtype: torch.dtype = torch.float32) -> MatmulBackend:
    """The matmuls for a model run in `dtype`.

    name 'auto': bfloat16 on AMX tiles where the CPU has AMX-BF16 and the model runs in bfloat16, else the packed
    kernel where it builds, else torch; 'amx' and 'packed' insist on their kernel ('amx' needs bfloat16).
    quantization 'auto' or 'gguf': GGUF's blocks run as they are, on AMX tiles where AMX runs the model (dequantized
    into tiles as the kernel goes: the bits of the bfloat16 weights from a third of the bytes), else in the quantized
    kernel ('auto': where it builds; 'gguf' insists on it); 'none' dequantizes every weight."""
    if name not in MATMUL_BACKENDS:
        raise ValueError(f"unknown matmul backend {name!r}; choose one of {MATMUL_BACKENDS}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    if name == "amx" and dtype != torch.bfloat16:
        raise ValueError(f"matmul_backend='amx' runs bfloat16 models, not {dtype}")
    amx = None
    if name in ("auto", "amx") and dtype == torch.bfloat16:
        amx = kernel_for("matmul_backend", name, "amx", load_amx_linear)
    amx_blocks = amx is not None and quantization != "none"
    quantized = None
    if not amx_blocks and (quantization == "gguf" or (quantization == "auto" and amx is None)):
        quantized = kernel_for("quantization", quantization, "gguf", load_quantized_linear)
    if name == "torch":
        return MatmulBackend(None, quantized)
    packed = None if name == "amx" else kernel_for("matmul_backend", name, "packed", load_packed_linear)
    return MatmulBackend(packed, quantized, amx, amx_blocks)
