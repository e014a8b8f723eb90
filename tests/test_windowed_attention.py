"""The sliding-window kernel equals the obvious windowed attention, and gives a row the same bits in any chunk or
batch."""

from __future__ import annotations

import pytest
import torch

from loom.model.kernels import load_windowed_attention


@pytest.fixture(scope="module")
def kernel():
    module = load_windowed_attention()
    assert module is not None, "the C++ kernel must build on the CI machine"
    return module


def caches(gen, num_blocks, block_size, kv_heads, head_dim, dtype):
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    return k, v


def obvious(q, k_cache, v_cache, table, ctx, window, scale):
    """The last q.shape[0] positions of a ctx-token sequence, each over its window, in float32."""
    n, heads = q.shape[0], q.shape[1]
    group = heads // k_cache.shape[2]
    keys = k_cache[table].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
    values = v_cache[table].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
    q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
    k_pos = torch.arange(ctx).unsqueeze(0)
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)
    scores = torch.einsum("nhd,chd->hnc", q.float(), keys) * scale
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [(4, 1, 256, 16, 512), (4, 2, 32, 8, 5),
                                                                      (6, 3, 30, 4, 1), (2, 2, 64, 16, 100)])
def test_kernel_matches_obvious_windowed_attention(kernel, dtype, heads, kv_heads, head_dim, block_size, window):
    gen = torch.Generator().manual_seed(head_dim + window)
    lens, query_lens = [700, 37, 1, 12], [1, 37, 1, 5]  # a decode, a whole prompt, a first token, a later chunk
    blocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks), generator=gen)  # blocks anywhere in the cache
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int64)
    used = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[used:used + b]
        used += b
    k_cache, v_cache = caches(gen, sum(blocks), block_size, kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int64)
    scale = head_dim**-0.5
    out = kernel.windowed_attention(q, k_cache, v_cache, tables, torch.tensor(lens), cu, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (ctx, n) in enumerate(zip(lens, query_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        want = obvious(q[rows], k_cache, v_cache, tables[i, :blocks[i]], ctx, window, scale)
        torch.testing.assert_close(out[rows].view(n, heads, head_dim).float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_chunk_or_batch(kernel, dtype):
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, window, ctx = 4, 1, 64, 16, 40, 90
    k_cache, v_cache = caches(gen, 8, block_size, kv_heads, head_dim, dtype)
    table = torch.randperm(8, generator=gen)[:6].unsqueeze(0)
    q = torch.randn(ctx, heads, head_dim, generator=gen).to(dtype)
    whole = kernel.windowed_attention(q, k_cache, v_cache, table, torch.tensor([ctx]), torch.tensor([0, ctx]),
                                      window, 0.125)
    for start in (0, 17, 60, 89):  # the chunk [start, ctx) alone, behind another sequence's rows
        other = torch.randn(3, heads, head_dim, generator=gen).to(dtype)
        tables = torch.cat([table, table])
        out = kernel.windowed_attention(torch.cat([other, q[start:]]), k_cache, v_cache, tables,
                                        torch.tensor([50, ctx]), torch.tensor([0, 3, 3 + ctx - start]), window, 0.125)
        assert torch.equal(out[3:], whole[start:])


def test_query_rows_may_be_views_of_wider_rows(kernel):
    """q as the model passes it, a view of each row's q and k heads: the bits of the same q made contiguous."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size, ctx = 4, 1, 64, 16, 50
    k_cache, v_cache = caches(gen, 4, block_size, kv_heads, head_dim, torch.bfloat16)
    table = torch.arange(4).unsqueeze(0)
    qk = torch.randn(ctx, (heads + kv_heads) * head_dim, generator=gen).bfloat16()
    q = qk[:, : heads * head_dim].view(ctx, heads, head_dim)
    assert not q.is_contiguous()
    args = (k_cache, v_cache, table, torch.tensor([ctx]), torch.tensor([0, ctx]), 20, 0.125)
    assert torch.equal(kernel.windowed_attention(q, *args), kernel.windowed_attention(q.contiguous(), *args))
