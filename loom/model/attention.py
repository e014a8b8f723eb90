"""Ragged paged attention: write this step's K/V at their slots, then attend block-diagonal causal.

Two backends share one signature:
- `SdpaAttention` (fast): all decode tokens of the step in one batched SDPA over K/V read straight from their
  blocks; each prefill chunk in one SDPA call (a few big kernels, never a loop of tiny per-request ones).
- `ReferenceAttention` (obvious): per sequence, gather its context, build the causal mask, softmax by hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from loom.engine.batch import BatchMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class AttentionBackend(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: BatchMetadata, scale: float
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for this step's tokens -> attention output [T, H*D]."""


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's K/V at its slot (block * block_size + offset); nothing else is copied."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one sequence's first `length` tokens, [length, KVH, D], read through its block table."""
    return cache[block_ids].flatten(0, 1)[:length]


class PagedAttention:
    """Both backends: store the step's K/V at their slots, then fill out[T, H, D] from the cache."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: BatchMetadata, scale: float
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        self.attend(q, k, v, kv_cache, meta, scale, out)
        return out.view(q.shape[0], -1)

    def attend(self, q, k, v, kv_cache: KVCache, meta: BatchMetadata, scale: float, out: torch.Tensor) -> None:
        raise NotImplementedError


class SdpaAttention(PagedAttention):
    """Batched decode + per-chunk prefill on torch's scaled_dot_product_attention."""

    def attend(self, q, k, v, kv_cache: KVCache, meta: BatchMetadata, scale: float, out: torch.Tensor) -> None:
        k_cache, v_cache = kv_cache
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k.shape[1]
        nd = meta.num_decodes
        if nd:
            # Queries of one KV head's group act as that head's query rows: exact GQA, no K/V repeat.
            tables = meta.block_tables[:nd, : meta.decode_max_blocks]
            keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [nd, KVH, L, D]
            values = v_cache[tables].flatten(1, 2).transpose(1, 2)
            q_grouped = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
            o = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=meta.decode_mask, scale=scale)
            out[:nd] = o.reshape(nd, num_heads, head_dim)

        for i in range(nd, meta.num_seqs):
            start, end = meta.query_starts[i], meta.query_starts[i + 1]
            ctx = meta.context_lens_host[i]
            qi = q[start:end].transpose(0, 1)  # [H, n, D]
            n = end - start
            if ctx == n:  # the whole context is this chunk: keys are the fresh ones, plain causal
                ki, vi = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:  # a later chunk: earlier tokens come from the cache, causal with an offset
                blocks = meta.block_tables[i, : meta.num_blocks_host[i]]
                ki = _gather_context(k_cache, blocks, ctx).transpose(0, 1)
                vi = _gather_context(v_cache, blocks, ctx).transpose(0, 1)
                mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)


class ReferenceAttention(PagedAttention):
    """Per sequence: gather its whole context from the cache, explicit causal mask, softmax(QK^T)V."""

    def attend(self, q, k, v, kv_cache: KVCache, meta: BatchMetadata, scale: float, out: torch.Tensor) -> None:
        k_cache, v_cache = kv_cache
        group = q.shape[1] // k.shape[1]
        for i in range(meta.num_seqs):
            start, end = meta.query_starts[i], meta.query_starts[i + 1]
            ctx = meta.context_lens_host[i]
            blocks = meta.block_tables[i, : meta.num_blocks_host[i]]
            keys = _gather_context(k_cache, blocks, ctx).repeat_interleave(group, dim=1)  # [ctx, H, D]
            values = _gather_context(v_cache, blocks, ctx).repeat_interleave(group, dim=1)
            q_pos = torch.arange(ctx - (end - start), ctx).unsqueeze(1)
            allowed = torch.arange(ctx).unsqueeze(0) <= q_pos  # [n, ctx]
            scores = torch.einsum("nhd,chd->hnc", q[start:end].float(), keys.float()) * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start:end] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), values.float()).to(q.dtype)


def make_attention(name: str) -> AttentionBackend:
    if name == "sdpa":
        return SdpaAttention()
    if name == "reference":
        return ReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}")
