"""Ragged paged attention: write this step's K/V at their slots, then attend block-diagonal causal.

Three backends share one signature:
- `PagedKernelAttention` (fastest on CPU): Loom's C++ kernels, one call per layer that stores the step's K/V and
  attends, reading K and V through the block tables in place. One kernel takes every decode token of the step,
  reading each request's K and V once; the other every prompt chunk, flash-attention style (tiles of query rows,
  online softmax, scores kept in cache).
- `SdpaAttention` (portable): all decode tokens in one batched SDPA over K/V gathered through the block tables
  (a temporary copy per layer); each prefill chunk in one SDPA call.
- `ReferenceAttention` (obvious): per sequence, gather its context, build the causal mask, softmax by hand.

A sliding-window layer passes `window`: each query then sees only the last `window` positions up to its own.
PagedKernelAttention runs such a layer on its own kernel (csrc/windowed_attention.cpp: one query row at a time, so
its bits never depend on the batch), and as SdpaAttention does on an int8 cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from loom.config import ATTENTION_BACKENDS
from loom.model.kernels import kernel_for, load_paged_attention, load_windowed_attention
from loom.model.kv_quant import dequantize_heads, quantize_heads

if TYPE_CHECKING:
    from loom.model.batch_metadata import BatchMetadata

class KVCache(NamedTuple):
    """One layer's paged caches, K and V each [num_blocks, block_size, num_kv_heads, head_dim] of the model's dtype,
    or of int8 codes with float32 scales [num_blocks, block_size, num_kv_heads] (kv_quant.py; None otherwise).
    K and V may be views with blocks further apart than their size (KVCacheSpec.allocate); a block's rows are
    contiguous."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None

    def blocks(self, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, [len(block_ids), block_size, num_kv_heads, head_dim] each, as `dtype`."""
        if self.k_scales is None:
            return self.k[block_ids].to(dtype), self.v[block_ids].to(dtype)
        return (dequantize_heads(self.k[block_ids], self.k_scales[block_ids]).to(dtype),
                dequantize_heads(self.v[block_ids], self.v_scales[block_ids]).to(dtype))


class AttentionBackend(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: BatchMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for this step's tokens -> attention output [T, H*D]; with `window`, each
        query attends to the last `window` positions only (its own included)."""


def causal_mask(n: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[n, ctx] bool: the last n of ctx positions query, each seeing itself, the keys before it, and with `window`
    no key `window` or more positions back."""
    q_pos = torch.arange(ctx - n, ctx, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    return allowed if window is None else allowed & (k_pos > q_pos - window)


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's K/V at its slot (block * block_size + offset), quantized for an int8 cache; nothing
    else is copied."""
    block_size = kv_cache.k.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    for cache, scales, rows in ((kv_cache.k, kv_cache.k_scales, k), (kv_cache.v, kv_cache.v_scales, v)):
        if scales is not None:
            rows, row_scales = quantize_heads(rows)
            scales[blocks, offsets] = row_scales
        cache[blocks, offsets] = rows


def _gather_context(kv_cache: KVCache, block_ids: torch.Tensor, length: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `length` tokens, [length, KVH, D] each as `dtype`, through its block table."""
    keys, values = kv_cache.blocks(block_ids, dtype)
    return keys.flatten(0, 1)[:length], values.flatten(0, 1)[:length]


def _prefill_chunks(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: BatchMetadata
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """For each prompt chunk: its rows [start, end) and the K/V of its whole context, [ctx, KVH, D] each.

    A first chunk's context is the chunk itself (the fresh k/v rows); a later one's is read back from the cache, as
    is every chunk's from an int8 cache (so that a chunk sees its own K/V as the chunks after it will).
    """
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = meta.query_starts[i], meta.query_starts[i + 1]
        ctx = meta.context_lens_host[i]
        if ctx == end - start and kv_cache.k_scales is None:
            yield start, end, k[start:end], v[start:end]
        else:
            blocks = meta.block_tables[i, : meta.num_blocks_host[i]]
            yield start, end, *_gather_context(kv_cache, blocks, ctx, k.dtype)


class PagedAttention:
    """Both backends: store the step's K/V at their slots, then fill out[T, H, D] from the cache."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: BatchMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        self.store(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        self.attend(q, k, v, kv_cache, meta, scale, out, window)
        return out.view(q.shape[0], -1)

    def store(self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(kv_cache, k, v, slot_mapping)

    def attend(self, q, k, v, kv_cache: KVCache, meta: BatchMetadata, scale: float, out: torch.Tensor,
               window: int | None = None) -> None:
        raise NotImplementedError


class SdpaAttention(PagedAttention):
    """Batched decode + per-chunk prefill on torch's scaled_dot_product_attention."""

    def attend(self, q, k, v, kv_cache: KVCache, meta: BatchMetadata, scale: float, out: torch.Tensor,
               window: int | None = None) -> None:
        if meta.num_decodes:
            self.attend_decodes(q, kv_cache, meta, scale, out, window)
        self.attend_prefills(q, k, v, kv_cache, meta, scale, out, window)

    def attend_decodes(self, q, kv_cache: KVCache, meta: BatchMetadata, scale: float, out: torch.Tensor,
                       window: int | None = None) -> None:
        """Rows [0, num_decodes): one query token each."""
        nd, num_heads, head_dim = meta.num_decodes, q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.k.shape[2]
        # Queries of one KV head's group act as that head's query rows: exact GQA, no K/V repeat.
        tables = meta.block_tables[:nd, : meta.decode_max_blocks].flatten()
        keys, values = kv_cache.blocks(tables, q.dtype)
        keys = keys.view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)  # [nd, KVH, L, D]
        values = values.view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        q_grouped = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = meta.decode_mask if window is None else meta.windowed_decode_mask(window)
        o = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=mask, scale=scale)
        out[:nd] = o.reshape(nd, num_heads, head_dim)

    def attend_prefills(self, q, k, v, kv_cache: KVCache, meta: BatchMetadata, scale: float, out: torch.Tensor,
                        window: int | None = None):
        """Rows [num_decodes, num_seqs): one SDPA call per prompt chunk."""
        for start, end, keys, values in _prefill_chunks(k, v, kv_cache, meta):
            n, ctx = end - start, keys.shape[0]
            qi, ki, vi = q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # [heads, len, D]
            if ctx == n and (window is None or window >= ctx):  # the whole context is this chunk: plain causal
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:  # a later chunk (causal with an offset), or a window
                mask = causal_mask(n, ctx, window, q.device)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)


class PagedKernelAttention(SdpaAttention):
    """CPU: one call of the compiled kernels a layer (`attend_step`: store the step's K/V, attend its decodes and its
    prompt chunks); other devices as SdpaAttention."""

    def __init__(self, kernel: ModuleType, windowed: ModuleType | None = None) -> None:
        self.kernel, self.windowed = kernel, windowed

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: BatchMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None and q.is_cpu and self.windowed is not None and kv_cache.k_scales is None:
            self.kernel.write_kv(k, v, kv_cache.k, kv_cache.v, meta.slot_mapping)
            return self.windowed.windowed_attention(q, kv_cache.k, kv_cache.v, meta.block_tables, meta.context_lens,
                                                    meta.cu_seqlens_q, window, scale)
        if not q.is_cpu or window is not None:
            return super().__call__(q, k, v, kv_cache, meta, scale, window)
        return self.kernel.attend_step(q, k, v, *kv_cache, meta.slot_mapping, meta.block_tables, meta.context_lens,
                                       meta.cu_seqlens_q, meta.num_decodes, scale)


class ReferenceAttention(PagedAttention):
    """Per sequence: gather its whole context from the cache, explicit causal mask, softmax(QK^T)V."""

    def attend(self, q, k, v, kv_cache: KVCache, meta: BatchMetadata, scale: float, out: torch.Tensor,
               window: int | None = None) -> None:
        group = q.shape[1] // k.shape[1]
        for i in range(meta.num_seqs):
            start, end = meta.query_starts[i], meta.query_starts[i + 1]
            ctx = meta.context_lens_host[i]
            blocks = meta.block_tables[i, : meta.num_blocks_host[i]]
            keys, values = _gather_context(kv_cache, blocks, ctx, torch.float32)
            keys = keys.repeat_interleave(group, dim=1)  # [ctx, H, D]
            values = values.repeat_interleave(group, dim=1)
            allowed = causal_mask(end - start, ctx, window, q.device)  # [n, ctx]
            scores = torch.einsum("nhd,chd->hnc", q[start:end].float(), keys) * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start:end] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), values).to(q.dtype)




def make_attention(name: str) -> AttentionBackend:
    """'auto': the compiled kernel when it builds on this machine, else SDPA; 'paged' insists on the kernel."""
    if name in ("auto", "paged"):
        kernel = kernel_for("attention_backend", name, "paged", load_paged_attention)
        return SdpaAttention() if kernel is None else PagedKernelAttention(kernel, load_windowed_attention())
    if name == "sdpa":
        return SdpaAttention()
    if name == "reference":
        return ReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")
