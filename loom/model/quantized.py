"""GGUF's quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_1, Q5_K, Q6_K) kept as the file stores them, and repacked for
Loom's quantized kernel.

A GGUF row of a [out, in] weight is a run of blocks, each 32 weights with a float16 scale d (and for Q4_1 a float16
offset m): Q4_0 stores 4-bit codes q (w = d (q - 8), 18 bytes a block), Q4_1 too (w = d q + m, 20 bytes), Q8_0
signed bytes (w = d q, 34 bytes). The kernel (csrc/quantized_linear.cpp) wants panels of 16 output rows with each
block's 16 scales, 16 offsets and codes side by side; `pack_records` builds that layout once, at model load. Q4_0
runs as Q4_1 with m = -8 d: d q and 8 d are exact in float32, so fma(q, d, -8 d) is exactly gguf's d (q - 8).

Q5_0 (5-bit codes, w = d (q - 16), 22 bytes a block) is rewritten as Q8_0 at load (`q8_0_from_q5_0`): the same d,
codes q - 16, the same weights to the bit, 8.5 bits a weight in memory instead of 5.5; it then fuses with Q8_0
neighbours (a Q4_K_M file's q/k in Q5_0 beside v in Q8_0).

Q4_K groups 8 blocks of 32 in a super-block of 256 (144 bytes): float16 d and dmin, each block's 6-bit scale sc and
min m, 4-bit codes q; w = (d sc) q - dmin m. Its kernel records are Q4_1's with float32 scales (`q4_1f`): d sc and
-dmin m are exact in float32 (11-bit times 6-bit significands), so fma(q, d sc, -dmin m) is gguf's value to the bit;
6 bits a weight in memory instead of 4.5.

Q5_1 (w = d q + m, 5-bit codes, 24 bytes a block), Q5_K (Q4_K with 5-bit codes, 176 bytes a super-block) and Q6_K
(16 blocks of 16 with int8 scales sc and one float16 d, w = (d sc) (q - 32), 210 bytes) share one kernel record,
`q8f`: int8 codes with float32 scales for the block's first and second 16 weights and a float32 offset. Every
product d q is exact in float32 (at most 11 + 7 + 5 significant bits), so fma(q, d, m) rounds gguf's value once, as
gguf does (Q6_K's offset is -0.0, so a zero weight keeps gguf's sign); 11 bits a weight in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per GGUF block, along in_features
# One block (a K-quant's: one super-block of 256 weights) as GGUF stores it, its weights, the kernel's record layout.
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q4_k": 144, "q5_1": 24, "q5_k": 176, "q6_k": 210}
BLOCK_WEIGHTS = {"q4_0": BLOCK, "q4_1": BLOCK, "q8_0": BLOCK, "q4_k": 256, "q5_1": BLOCK, "q5_k": 256, "q6_k": 256}
KERNEL_FORMAT = {"q4_0": "q4_1", "q4_1": "q4_1", "q8_0": "q8_0", "q4_k": "q4_1f", "q5_1": "q8f", "q5_k": "q8f",
                 "q6_k": "q8f"}
PANEL_ROWS = 16


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight in GGUF's blocks: `blocks` is uint8 [out_features, in / 32 * bytes]."""

    format: str  # a key of BLOCK_BYTES
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        if self.format not in BLOCK_BYTES:
            raise ValueError(f"quantized format must be one of {sorted(BLOCK_BYTES)}, got {self.format!r}")
        block_bytes = BLOCK_BYTES[self.format]
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] % block_bytes:
            raise ValueError(f"{self.format} blocks must be uint8 [rows, a multiple of {block_bytes}]")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] // BLOCK_BYTES[self.format] * BLOCK_WEIGHTS[self.format]


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The weights stacked along out_features (fused q/k/v, gate/up), or None if their formats differ."""
    formats = {w.format for w in weights}
    if len(formats) != 1:
        return None
    return QuantizedWeight(formats.pop(), torch.cat([w.blocks for w in weights]))


def take_blocks(quantized: dict[str, QuantizedWeight], names: Sequence[str]) -> QuantizedWeight | None:
    """The named weights' GGUF blocks, taken out of `quantized` and stacked by rows (fused q/k/v, gate/up), when all
    of them have theirs."""
    blocks = [quantized.pop(n, None) for n in names]
    return None if any(b is None for b in blocks) else concat_rows(blocks)


def q8_0_from_q5_0(blocks: np.ndarray) -> np.ndarray:
    """uint8 [rows, n * 22] Q5_0 blocks -> [rows, n * 34] Q8_0 blocks of the same weights. A Q5_0 block: d (float16),
    the fifth bits of its 32 codes in a little-endian 32-bit word, then 16 bytes of low nibbles (weight j in byte j %
    16, low nibble for j < 16, high for the rest)."""
    rows = blocks.shape[0]
    raw = blocks.reshape(rows, -1, 22)
    fifth = (np.ascontiguousarray(raw[..., 2:6]).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    packed = raw[..., 6:22]
    low = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int16)
    codes = (low + (fifth.astype(np.int16) << 4) - 16).astype(np.int8).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([raw[..., 0:2], codes], axis=-1).reshape(rows, -1))


def pack_records(weight: QuantizedWeight, step_pairs: bool = False) -> torch.Tensor:
    """uint8 [ceil(out / 16), in / 32, record bytes]: panel p, block b holds rows 16p..16p+15 (zero-padded: d = m = 0
    gives weights of 0) of block b, in the layout of KERNEL_FORMAT[format] that csrc/quantized_linear.cpp documents.

    step_pairs: the codes of steps 2r and 2r + 1 interleaved byte by byte (column by column for Q8_0), the order of
    an AMX tile's row r, so that csrc/amx_dequantize.h widens them without shuffling."""
    if weight.format == "q4_k":
        return _q4_1f_records(weight, step_pairs)
    if KERNEL_FORMAT[weight.format] == "q8f":
        return _q8f_records(weight, step_pairs)
    fmt, out_features = weight.format, weight.out_features
    num_blocks = weight.in_features // BLOCK
    num_panels = -(-out_features // PANEL_ROWS)
    raw = np.zeros((num_panels * PANEL_ROWS, num_blocks, BLOCK_BYTES[fmt]), dtype=np.uint8)
    raw[:out_features] = weight.blocks.numpy().reshape(out_features, num_blocks, BLOCK_BYTES[fmt])
    # [panel, block, column, bytes]: the 16 rows of a panel become the 16 columns of each record.
    raw = raw.reshape(num_panels, PANEL_ROWS, num_blocks, -1).transpose(0, 2, 1, 3)
    scales = raw[..., 0:2].reshape(num_panels, num_blocks, 2 * PANEL_ROWS)  # d of columns 0-15, float16 bytes
    if fmt == "q8_0":
        codes = raw[..., 2:].transpose(0, 1, 3, 2)  # int8 codes [panel, block, k, column]
        if step_pairs:
            codes = _pairs_of_steps(codes)
        parts = [scales, codes.reshape(num_panels, num_blocks, -1)]
    else:
        offsets = _minus_8d(raw[..., 0:2]) if fmt == "q4_0" else raw[..., 2:4]  # m of columns 0-15
        packed = raw[..., BLOCK_BYTES[fmt] - 16:]  # byte j: weight j in the low nibble, weight j + 16 in the high one
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [panel, block, column, k]
        codes = codes.transpose(0, 1, 3, 2)  # [panel, block, k, column]
        step_bytes = codes[..., :8] | (codes[..., 8:] << 4)  # byte c of step k: column c, column c + 8 above it
        if step_pairs:
            step_bytes = _pairs_of_steps(step_bytes)
        parts = [scales, offsets.reshape(num_panels, num_blocks, -1), step_bytes.reshape(num_panels, num_blocks, -1)]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)))


def _q4_1f_records(weight: QuantizedWeight, step_pairs: bool) -> torch.Tensor:
    """Q4_K as `q4_1f` records: d[16] float32 (d sc) | m[16] float32 (-dmin m) | Q4_1's 32 x 8 code bytes."""
    from gguf.quants import Q4_K

    out_features, num_super = weight.out_features, weight.in_features // 256
    num_panels = -(-out_features // PANEL_ROWS)
    raw = np.zeros((num_panels * PANEL_ROWS, num_super, 144), dtype=np.uint8)
    raw[:out_features] = weight.blocks.numpy().reshape(out_features, num_super, 144)
    flat = raw.reshape(-1, 144)
    d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(flat[:, 4:16])  # [n, 8] each
    scales = (d * sc.astype(np.float32)).reshape(num_panels, PANEL_ROWS, num_super * 8)
    offsets = (-(dmin * mins.astype(np.float32))).reshape(num_panels, PANEL_ROWS, num_super * 8)
    # A super-block's codes: 4 runs of 32 bytes; run r holds block 2r in its low nibbles and block 2r + 1 in its high.
    runs = flat[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (runs & 0x0F).reshape(num_panels, PANEL_ROWS, num_super * 8, BLOCK)  # [panel, column, block, k]
    codes = codes.transpose(0, 2, 3, 1)  # [panel, block, k, column]
    step_bytes = codes[..., :8] | (codes[..., 8:] << 4)
    if step_pairs:
        step_bytes = _pairs_of_steps(step_bytes)
    num_blocks = num_super * 8
    parts = [np.ascontiguousarray(scales.transpose(0, 2, 1)).view(np.uint8),  # float32, little-endian
             np.ascontiguousarray(offsets.transpose(0, 2, 1)).view(np.uint8),
             step_bytes.reshape(num_panels, num_blocks, -1)]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)))


def _q8f_fields(fmt: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks [n, block bytes] -> per block of 32 weights: scales of its first and second 16 weights, offset
    (float32 [n, blocks]) and codes (int8 [n, blocks, 32]), as gguf's dequantizers read them."""
    n = raw.shape[0]
    if fmt == "q5_1":
        d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
        fifth = (np.ascontiguousarray(raw[:, 4:8]).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
        low = np.concatenate([raw[:, 8:24] & 0x0F, raw[:, 8:24] >> 4], axis=-1)
        codes = (low | (fifth.astype(np.uint8) << 4)).astype(np.int8).reshape(n, 1, BLOCK)
        return d, d, m, codes
    if fmt == "q5_k":
        from gguf.quants import Q4_K

        d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mins = Q4_K.get_scale_min(raw[:, 4:16])  # [n, 8]
        scales = d * sc.astype(np.float32)
        low = (raw[:, 48:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (raw[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        codes = (low.reshape(n, 8, 32) | (high << 4)).astype(np.int8)
        return scales, scales, -(dmin * mins.astype(np.float32)), codes
    # q6_k: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, float16 d
    d = raw[:, 208:210].copy().view(np.float16).astype(np.float32)
    scales = (d * raw[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 8, 2)
    low = (raw[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (raw[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    return scales[..., 0], scales[..., 1], np.full((n, 8), -0.0, np.float32), codes


def _q8f_records(weight: QuantizedWeight, step_pairs: bool) -> torch.Tensor:
    """Q5_1, Q5_K, Q6_K as `q8f` records: d[16] float32 (k 0-15) | d[16] float32 (k 16-31) | m[16] float32 | 32
    steps x 16 int8 codes (Q8_0's layout)."""
    fmt, out_features = weight.format, weight.out_features
    per_row = weight.blocks.shape[1] // BLOCK_BYTES[fmt]
    num_panels = -(-out_features // PANEL_ROWS)
    raw = np.zeros((num_panels * PANEL_ROWS * per_row, BLOCK_BYTES[fmt]), dtype=np.uint8)
    raw[: out_features * per_row] = weight.blocks.numpy().reshape(-1, BLOCK_BYTES[fmt])
    num_blocks = weight.in_features // BLOCK
    fields = _q8f_fields(fmt, raw)

    def by_column(a: np.ndarray) -> np.ndarray:  # [rows, blocks] -> [panel, block, column] float32 bytes
        a = a.reshape(num_panels, PANEL_ROWS, num_blocks).transpose(0, 2, 1)
        return np.ascontiguousarray(a, dtype=np.float32).view(np.uint8)

    codes = fields[3].reshape(num_panels, PANEL_ROWS, num_blocks, BLOCK).transpose(0, 2, 3, 1)  # [.., k, column]
    if step_pairs:
        codes = _pairs_of_steps(codes)
    parts = [*(by_column(a) for a in fields[:3]), codes.reshape(num_panels, num_blocks, -1).view(np.uint8)]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)))


def _pairs_of_steps(steps: np.ndarray) -> np.ndarray:
    """[panel, block, k, bytes] -> [panel, block, k / 2, bytes, 2]: each pair of steps' bytes interleaved."""
    panels, blocks, k, width = steps.shape
    return steps.reshape(panels, blocks, k // 2, 2, width).transpose(0, 1, 2, 4, 3)


def _minus_8d(scale_bytes: np.ndarray) -> np.ndarray:
    """Q4_0's offsets as Q4_1 stores them: float16 -8 d, as bytes; exact unless 8 d overflows float16."""
    d = np.ascontiguousarray(scale_bytes).view(np.float16).astype(np.float32)
    with np.errstate(over="ignore"):  # an overflow is refused just below
        minus_8d = (-8 * d).astype(np.float16)
    if not np.isfinite(minus_8d).all():
        raise ValueError("a Q4_0 scale is too large to run as Q4_1 (|8 d| beyond float16)")
    return minus_8d.view(np.uint8)
