"""Loom's CPU attention paths (the compiled decode kernel, the tiled prefill chunks) equal the obvious attention."""

from __future__ import annotations

import pytest
import torch

from loom.model.attention import tiled_chunk_attention
from loom.model.kernels import load_paged_attention


@pytest.fixture(scope="module")
def kernel():
    module = load_paged_attention()
    assert module is not None, "the C++ kernel must build on the CI machine"
    return module


def obvious_decode(q, k_cache, v_cache, tables, lens, scale):
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lens.tolist()):
        keys = k_cache[tables[i]].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_cache[tables[i]].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), keys) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,block_size",
    [
        (torch.float32, 9, 3, 64, 16),  # SmolLM2's shape
        (torch.float32, 4, 4, 128, 8),  # no GQA, the other compiled head size
        (torch.float32, 6, 2, 24, 1),  # a head size read at run time, one token per block
        (torch.bfloat16, 9, 3, 64, 16),
    ],
)
def test_kernel_matches_obvious_attention(kernel, dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(0)
    num_blocks, seqs = 1000, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 90, 5])
    max_blocks = int(-(-lens.max() // block_size)) + 2  # tables padded past each context, as the engine pads them
    tables = torch.randperm(num_blocks - 1, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks) + 1
    q = torch.randn(seqs, heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    kernel.decode_attention(q, k_cache, v_cache, tables, lens, out, head_dim**-0.5)
    expected = obvious_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_kernel_rejects_bad_lengths(kernel):
    q = torch.zeros(2, 2, 8)
    cache = torch.zeros(4, 2, 1, 8)
    tables = torch.ones(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        kernel.decode_attention(q, cache, cache, tables, torch.tensor([3, 5]), torch.empty_like(q), 1.0)
    with pytest.raises(RuntimeError, match="at least one key"):
        kernel.decode_attention(q, cache, cache, tables, torch.tensor([0, 1]), torch.empty_like(q), 1.0)


def obvious_chunk(q, keys, values, scale):
    """Causal attention of the last n of ctx positions, one head at a time, with a full mask."""
    n, ctx, group = q.shape[0], keys.shape[0], q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), keys) * scale
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize(
    "n,ctx,heads,kv_heads,max_scores",
    [
        (1, 1, 9, 3, 1 << 20),  # a one-token prompt
        (37, 37, 9, 3, 1 << 20),  # a whole prompt in one tile
        (100, 100, 9, 3, 9 * 100 * 16),  # a whole prompt in tiles of 16
        (45, 300, 9, 3, 9 * 300 * 20),  # a later chunk over cached context, in tiles of 20 (the last one partial)
        (5, 2000, 4, 4, 1 << 20),  # short chunk, long context, no GQA
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_chunk_attention_matches_obvious(n, ctx, heads, kv_heads, max_scores, dtype):
    gen = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, heads, 64, generator=gen).to(dtype)
    keys = torch.randn(ctx, kv_heads, 64, generator=gen).to(dtype)
    values = torch.randn(ctx, kv_heads, 64, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    tiled_chunk_attention(q, keys, values, 0.125, out, max_scores=max_scores)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), obvious_chunk(q, keys, values, 0.125), atol=tol, rtol=tol)
