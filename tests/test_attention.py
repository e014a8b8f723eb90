"""Loom's compiled CPU attention kernels (decode tokens, prefill chunks) equal the obvious attention."""

from __future__ import annotations

import pytest
import torch
from conftest import torch_threads

from loom.engine.kv_cache import KVCacheSpec
from loom.model.attention import KVCache, write_kv
from loom.model.kernels import load_paged_attention
from loom.model.kv_quant import quantize_heads


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


def attend_against_obvious(kernel, gen, dtype, tables, lens, heads=9, kv_heads=3, head_dim=64, block_size=16):
    """Random caches (as many blocks as `tables` reach) and queries; the kernel's outputs for `tables` and `lens`,
    checked against the obvious attention at the dtype's tolerance. Returns q, the caches and the outputs."""
    num_blocks = int(tables.max()) + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    batch = torch.full_like(q, float("nan"))
    kernel.decode_attention(q, k_cache, v_cache, tables, lens, batch, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batch.float(), obvious_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5),
                               atol=tol, rtol=tol)
    return q, k_cache, v_cache, batch


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,block_size",
    [
        (torch.float32, 9, 3, 64, 16),  # SmolLM2's shape: rows read in place
        (torch.float32, 4, 4, 128, 8),  # no GQA
        (torch.float32, 6, 2, 30, 1),  # a head size of part vectors (rows copied, padded), one token per block
        (torch.float32, 4, 2, 32, 4),  # whole vectors, their number read at run time
        (torch.bfloat16, 9, 3, 64, 16),  # AVX-512 BF16 where the CPU has it; scores on AMX where it has that
        (torch.bfloat16, 9, 3, 64, 32),  # AMX scores: two 16-token tiles a block
        (torch.bfloat16, 9, 3, 64, 8),  # scores by vectors: blocks smaller than a tile
        (torch.bfloat16, 9, 3, 64, 5),  # blocks that split 8-token groups (the values' walk takes their exps)
        (torch.bfloat16, 6, 2, 30, 5),  # rows widened
        (torch.bfloat16, 8, 2, 128, 16),  # 4 vectors (AMX: 4 tiles) a head, groups of 4
        (torch.bfloat16, 4, 4, 32, 4),  # one vector a head, no GQA
        (torch.bfloat16, 4, 2, 64, 16),  # groups of 2 (AVX2 alone: values two 16-value units a pass)
        (torch.bfloat16, 8, 1, 32, 16),  # one KV head for 8 query heads
    ],
)
def test_kernel_matches_obvious_attention(kernel, dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 90, 5, 8, 17, 300])  # whole and part 8-token groups
    max_blocks = int(-(-lens.max() // block_size)) + 2  # tables padded past each context, as the engine pads them
    seqs = len(lens)
    num_blocks = seqs * max_blocks + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks) + 1
    q = torch.randn(seqs, heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    kernel.decode_attention(q, k_cache, v_cache, tables, lens, out, head_dim**-0.5)
    expected = obvious_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    # Few sequences: two of unequal lengths, or one alone, whose halves go to two threads (bfloat16 with AVX-512):
    # the same bits as in the batch.
    for rows in (slice(4, 6), slice(9, 10)):
        few = torch.full_like(q[rows], float("nan"))
        kernel.decode_attention(q[rows].contiguous(), k_cache, v_cache, tables[rows], lens[rows], few, head_dim**-0.5)
        assert torch.equal(few, out[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_are_chunked_with_the_same_bits_in_any_batch(kernel, dtype):
    """Long contexts are attended in chunks merged at the end (so one long sequence keeps every thread busy: 256
    or 512 tokens, by the build's vector width); the chunks depend on the length alone, so a sequence gets the same
    bits alone and in a batch of 20, on any number of threads (alone, a chunk's halves may go to two threads)."""
    gen = torch.Generator().manual_seed(1)
    head_dim, block_size = 64, 16
    lens = torch.tensor([513, 600, 256, 1100, 5, 1024, 300, 1, 257, 1537] * 2)  # 1-7 chunks of 256, 1-4 of 512
    seqs, max_blocks = len(lens), 1537 // block_size + 2
    tables = (torch.randperm(seqs * max_blocks, generator=gen) + 1).view(seqs, max_blocks)
    q, k_cache, v_cache, batch = attend_against_obvious(kernel, gen, dtype, tables, lens)
    # Alone, a sequence's chunks and their halves go to threads as they share out: the bits stay.
    for num_threads in (1, 2, 3, 4):
        with torch_threads(num_threads):
            for i in range(10):
                alone = torch.full_like(q[i:i + 1], float("nan"))
                kernel.decode_attention(q[i:i + 1].contiguous(), k_cache, v_cache, tables[i:i + 1], lens[i:i + 1],
                                        alone, head_dim**-0.5)
                assert torch.equal(alone, batch[i:i + 1]), f"context {int(lens[i])}, {num_threads} threads"


@pytest.mark.parametrize("length", [40, 300, 600])
def test_a_lone_sequence_gets_its_batch_bits_on_any_threads(kernel, length):
    """Alone (a step of few items), each half of a sequence's chunk may go to its own thread and the halves' sums are
    added at the end: the same sums as one thread's, so the same bits as in a full batch. bfloat16 outputs hide most
    float32 differences, so many queries: 64 on one context, alone on 1-4 threads against the batch of all 64."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, block_size, seqs = 9, 3, 64, 16, 64
    max_blocks = length // block_size + 2
    k_cache = torch.randn(max_blocks + 1, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(max_blocks + 1, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    tables = (torch.randperm(max_blocks, generator=gen) + 1).expand(seqs, max_blocks).contiguous()
    lens = torch.full((seqs,), length)
    q = (3 * torch.randn(seqs, heads, head_dim, generator=gen)).bfloat16()
    batch = torch.full_like(q, float("nan"))
    kernel.decode_attention(q, k_cache, v_cache, tables, lens, batch, head_dim**-0.5)
    for num_threads in (1, 2, 3, 4):
        with torch_threads(num_threads):
            alone = torch.full_like(q, float("nan"))
            for i in range(seqs):
                kernel.decode_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], alone[i:i + 1],
                                        head_dim**-0.5)
            assert torch.equal(alone, batch), f"{num_threads} threads"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequences_sharing_prefix_blocks_get_their_bits_alone(kernel, dtype):
    """Sequences whose tables begin with the same blocks (a prefix cache's shared prompts) are attended one after
    another by one thread, so the blocks they share come from its cache: every sequence still gets the obvious
    attention and the bits it gets alone, on any number of threads. Groups of 1-12 sequences share 1-40 blocks;
    some contexts are chunked (over 512 tokens), some end inside the shared blocks."""
    gen = torch.Generator().manual_seed(3)
    head_dim, block_size = 64, 16
    group_sizes, shared_blocks = [12, 1, 5, 3, 8, 2, 1, 4], [40, 3, 1, 18, 7, 25, 2, 9]
    seqs, max_blocks = sum(group_sizes), 60
    free = (torch.randperm(seqs * max_blocks, generator=gen) + 1).tolist()
    tables, lens = [], []
    for size, shared in zip(group_sizes, shared_blocks):
        prefix = [free.pop() for _ in range(shared)]
        for _ in range(size):
            tables.append(prefix + [free.pop() for _ in range(max_blocks - shared)])
            lens.append(int(torch.randint(1, (shared + 12) * block_size, (1,), generator=gen)))
    order = torch.randperm(seqs, generator=gen)  # the members of a group apart in the batch
    tables, lens = torch.tensor(tables)[order].contiguous(), torch.tensor(lens)[order]
    q, k_cache, v_cache, batch = attend_against_obvious(kernel, gen, dtype, tables, lens)
    for num_threads in (1, 2, 3):
        with torch_threads(num_threads):
            again = torch.full_like(q, float("nan"))
            kernel.decode_attention(q, k_cache, v_cache, tables, lens, again, head_dim**-0.5)
            assert torch.equal(again, batch), f"{num_threads} threads"
            for i in range(0, seqs, 5):
                alone = torch.full_like(q[i:i + 1], float("nan"))
                kernel.decode_attention(q[i:i + 1].contiguous(), k_cache, v_cache, tables[i:i + 1], lens[i:i + 1],
                                        alone, head_dim**-0.5)
                assert torch.equal(alone, batch[i:i + 1]), f"sequence {i}, {num_threads} threads"


def test_kernel_rejects_bad_lengths(kernel):
    q = torch.zeros(2, 2, 8)
    cache = torch.zeros(4, 2, 1, 8)
    tables = torch.ones(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        kernel.decode_attention(q, cache, cache, tables, torch.tensor([3, 5]), torch.empty_like(q), 1.0)
    with pytest.raises(RuntimeError, match="at least one key"):
        kernel.decode_attention(q, cache, cache, tables, torch.tensor([0, 1]), torch.empty_like(q), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_read_q_in_place_from_the_qkv_rows(kernel, dtype):
    """The forward hands the kernels q as a view of the fused qkv projection's rows (each row's q heads contiguous,
    rows a qkv row apart): the same bits as a contiguous copy, for decodes and prefill chunks; a q whose rows are not
    contiguous is refused."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    k_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = (torch.randperm(39, generator=gen)[:30] + 1).view(3, 10)
    qkv = torch.randn(40, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv.view(40, -1, head_dim)[:, :heads]
    assert not q.is_contiguous()
    lens, scale = torch.tensor([70, 33, 100]), head_dim**-0.5
    in_place, copied = torch.empty(3, heads, head_dim, dtype=dtype), torch.empty(3, heads, head_dim, dtype=dtype)
    kernel.decode_attention(q[:3], k_cache, v_cache, tables, lens, in_place, scale)
    kernel.decode_attention(q[:3].contiguous(), k_cache, v_cache, tables, lens, copied, scale)
    assert torch.equal(in_place, copied)
    starts = torch.tensor([0, 1, 8, 40])  # one decode row, then chunks of 7 and 32 tokens
    in_place, copied = torch.empty(40, heads, head_dim, dtype=dtype), torch.empty(40, heads, head_dim, dtype=dtype)
    kernel.prefill_attention(q, k_cache, v_cache, tables, lens, starts, 1, in_place, scale)
    kernel.prefill_attention(q.contiguous(), k_cache, v_cache, tables, lens, starts, 1, copied, scale)
    assert torch.equal(in_place[1:], copied[1:])
    with pytest.raises(RuntimeError, match="each row of q contiguous"):
        kernel.decode_attention(q[:3].transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache, tables, lens,
                                torch.empty(3, heads, head_dim, dtype=dtype), scale)


def obvious_chunk(q, keys, values, scale):
    """Causal attention of the last n of ctx positions, one head at a time, with a full mask."""
    n, ctx, group = q.shape[0], keys.shape[0], q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), keys) * scale
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),  # SmolLM2's shape
        (4, 4, 128, 8),  # no GQA
        (6, 2, 30, 5),  # a head size that is not a multiple of the kernel's 4-dim tiles, odd blocks
        (6, 2, 24, 1),  # one token per block: a softmax step spans 64 blocks
        (8, 2, 128, 16),  # bfloat16 on AMX where the CPU has it: four 32-dim tiles a head, groups of 4
        (4, 4, 32, 16),  # one 32-dim tile a head, no GQA
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_obvious(kernel, heads, kv_heads, head_dim, block_size, dtype):
    """Several chunks in one call, after two decode rows it must leave alone: first prompts (n == ctx) of 1, 37 and
    100 tokens (tiles of 24 query rows, the last partial), later chunks over cached context (45 of 300, 5 of 2000)."""
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    chunks = [(1, 1), (37, 37), (45, 300), (100, 100), (5, 2000)]  # (query tokens, context)
    num_decodes = 2
    lens = [3, 9] + [ctx for _, ctx in chunks]
    q_lens = [1, 1] + [n for n, _ in chunks]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    max_blocks = -(-max(lens) // block_size) + 1
    num_blocks = len(lens) * max_blocks + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks) + 1
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    kernel.prefill_attention(q, k_cache, v_cache, tables, torch.tensor(lens), starts, num_decodes, out, scale)
    assert out[:num_decodes].isnan().all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(num_decodes, len(lens)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        keys = k_cache[tables[i]].flatten(0, 1)[: lens[i]]
        values = v_cache[tables[i]].flatten(0, 1)[: lens[i]]
        expected = obvious_chunk(q[rows], keys, values, scale)
        torch.testing.assert_close(out[rows].float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_gets_the_same_bits_in_any_chunks(kernel, dtype):
    """Each query row's softmax walks the keys from key 0 in fixed steps, so a token's attention does not depend on
    the chunk or tile it is prefilled in: a 300-token prompt at once, or as chunks of 100, 150 and 50, on one thread
    or two (the kernel groups fewer tiles into a work item when there are more threads to share them)."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size, n = 9, 3, 64, 16, 300
    k_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = (torch.randperm(39, generator=gen)[:20] + 1).view(1, 20)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    whole = torch.empty_like(q)
    kernel.prefill_attention(q, k_cache, v_cache, tables, torch.tensor([n]), torch.tensor([0, n]), 0, whole, 0.125)
    for num_threads in (1, 2):
        with torch_threads(num_threads):
            chunked = torch.empty_like(q)
            for lo, hi in [(0, 100), (100, 250), (250, 300)]:
                part = torch.empty_like(q[lo:hi])
                kernel.prefill_attention(q[lo:hi].contiguous(), k_cache, v_cache, tables, torch.tensor([hi]),
                                         torch.tensor([0, hi - lo]), 0, part, 0.125)
                chunked[lo:hi] = part
            assert torch.equal(chunked, whole), f"{num_threads} threads"


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_short_chunks_in_one_call_get_the_bits_of_whole_prompts(kernel, heads, kv_heads, head_dim, int8):
    """Many chunks of under 16 tokens (a verification step's last tokens and drafts) go a sequence a work item, every
    KV head from one pass over its blocks, their query heads packed 16 lanes a tile: each row still gets the bits it
    gets in its whole prompt, prefilled alone (KV head by KV head, a head's tokens 16 a tile), on one thread or two,
    and with a long chunk in the same call."""
    gen = torch.Generator().manual_seed(heads + head_dim + int8)
    block_size = 16
    lens = [40, 300, 513, 17, 1000, 64, 5, 260]
    chunk_lens = [1, 7, 6, 15, 2, 5, 3, 4]
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if int8:
        caches = [quantize_heads(torch.randn(shape, generator=gen)) for _ in range(2)]
        k_cache, v_cache, extra = caches[0][0], caches[1][0], (caches[0][1], caches[1][1])
    else:
        k_cache = torch.randn(shape, generator=gen).bfloat16()
        v_cache = torch.randn(shape, generator=gen).bfloat16()
        extra = ()
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: len(lens) * max_blocks].view(len(lens), -1)
    prompts = [torch.randn(n, heads, head_dim, generator=gen).bfloat16() for n in lens]
    scale = head_dim**-0.5
    whole = []
    for i, n in enumerate(lens):
        out = torch.empty_like(prompts[i])
        kernel.prefill_attention(prompts[i], k_cache, v_cache, tables[i : i + 1], torch.tensor([n]),
                                 torch.tensor([0, n]), 0, out, scale, *extra)
        whole.append(out)
    for with_long_chunk in (False, True):
        # The last sequence's chunk is 200 tokens long in the second call: items of one KV head for it alone.
        q_lens = chunk_lens[:-1] + [200 if with_long_chunk else chunk_lens[-1]]
        starts = torch.tensor([0] + q_lens).cumsum(0)
        q = torch.cat([p[n - m :] for p, n, m in zip(prompts, lens, q_lens)])
        for num_threads in (1, 2):
            with torch_threads(num_threads):
                out = torch.full_like(q, float("nan"))
                kernel.prefill_attention(q, k_cache, v_cache, tables, torch.tensor(lens), starts, 0, out, scale,
                                         *extra)
            for i, (n, m) in enumerate(zip(lens, q_lens)):
                assert torch.equal(out[int(starts[i]) : int(starts[i + 1])], whole[i][n - m :]), (i, num_threads)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("slope", [0.005, 0.02, 0.3])
def test_prefill_softmax_follows_rising_scores(kernel, head_dim, slope):
    """Scores that climb along the keys (a sawtooth), at a different rate in each query lane: each lane's maximum
    moves mid-walk, by less or more than the kernel lets it lag before rescaling, and the result still matches, the
    same bits in any chunks."""
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, block_size, n = 4, 2, 16, 200
    direction = torch.ones(head_dim)
    ramp = (torch.arange(n) % 70).float() * slope
    keys = ramp[:, None, None] * direction + 0.1 * torch.randn(n, kv_heads, head_dim, generator=gen)
    k_cache = torch.zeros(14, block_size, kv_heads, head_dim)
    k_cache[1:].flatten(0, 1)[:n] = keys
    v_cache = torch.randn(14, block_size, kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    tables = torch.arange(1, 14).view(1, 13)
    q = ((1 + torch.arange(n) % 3).float()[:, None, None] * direction).expand(n, heads, head_dim).bfloat16()
    q = (q.float() + 0.1 * torch.randn(n, heads, head_dim, generator=gen)).bfloat16()
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    kernel.prefill_attention(q, k_cache, v_cache, tables, torch.tensor([n]), torch.tensor([0, n]), 0, out, scale)
    expected = obvious_chunk(q, k_cache[1:].flatten(0, 1)[:n], v_cache[1:].flatten(0, 1)[:n], scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    part = torch.empty_like(q[50:])
    kernel.prefill_attention(q[50:].contiguous(), k_cache, v_cache, tables, torch.tensor([n]),
                             torch.tensor([0, n - 50]), 0, part, scale)
    assert torch.equal(part, out[50:])


def test_prefill_kernel_rejects_bad_chunks(kernel):
    q = torch.zeros(4, 2, 8)
    cache = torch.zeros(4, 2, 1, 8)
    tables = torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="longer than its context"):
        kernel.prefill_attention(q, cache, cache, tables, torch.tensor([3]), torch.tensor([0, 4]), 0, q.clone(), 1.0)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        kernel.prefill_attention(q, cache, cache, tables, torch.tensor([5]), torch.tensor([0, 4]), 0, q.clone(), 1.0)
    with pytest.raises(RuntimeError, match="at least one query token"):
        kernel.prefill_attention(q, cache, cache, tables, torch.tensor([3]), torch.tensor([2, 2]), 0, q.clone(), 1.0)


@pytest.mark.parametrize("tokens", [5, 600])  # 600: the rows split between two threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_write_kv_matches_index_copy(kernel, dtype, tokens):
    """Strided k/v views of a fused qkv row land at their slots exactly as torch's index_copy_ puts them."""
    blocks, block_size, kv_heads, head_dim = 160, 4, 2, 8
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim).to(dtype)
    k = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(tokens))[:tokens]
    ours = [torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    torchs = [c.clone() for c in ours]
    with torch_threads(2):
        kernel.write_kv(k, v, *ours, slots)
    write_kv(KVCache(*torchs), k, v, slots)
    assert torch.equal(ours[0], torchs[0]) and torch.equal(ours[1], torchs[1])
    before = [c.clone() for c in ours]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.write_kv(k, v, *ours, torch.cat([slots[:-1], torch.tensor([blocks * block_size])]))
    assert torch.equal(ours[0], before[0]) and torch.equal(ours[1], before[1])  # nothing written


@pytest.mark.parametrize("num_decodes,chunks", [(2, [(37, 37), (5, 60)]), (3, []), (0, [(20, 20)])])
def test_attend_step_is_the_store_and_both_kernels(kernel, num_decodes, chunks):
    """One call a layer: the step's K/V stored, its decode rows and its prompt chunks attended, the same bits as the
    three kernels called apart; a bad count of decodes is refused."""
    gen = torch.Generator().manual_seed(3 + num_decodes)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    lens = [9, 30, 17][:num_decodes] + [ctx for _, ctx in chunks]
    q_lens = [1] * num_decodes + [n for n, _ in chunks]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    tokens = int(starts[-1])
    max_blocks = -(-max(lens) // block_size)
    tables = (torch.randperm(len(lens) * max_blocks, generator=gen) + 1).view(len(lens), max_blocks)
    positions = [p for n, ctx in zip(q_lens, lens) for p in range(ctx - n, ctx)]
    rows = [i for i, n in enumerate(q_lens) for _ in range(n)]
    slots = torch.tensor([int(tables[r, p // block_size]) * block_size + p % block_size
                          for r, p in zip(rows, positions)])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    q, k, v = qkv.view(tokens, -1, head_dim).split_with_sizes([heads, kv_heads, kv_heads], dim=1)
    caches = [torch.randn(len(lens) * max_blocks + 1, block_size, kv_heads, head_dim, generator=gen).bfloat16()
              for _ in range(2)]
    apart = [c.clone() for c in caches]
    lens_t, scale = torch.tensor(lens), head_dim**-0.5
    out = kernel.attend_step(q, k, v, *caches, None, None, slots, tables, lens_t, starts, num_decodes, scale)
    kernel.write_kv(k, v, *apart, slots)
    expected = torch.empty_like(q)
    if num_decodes:
        kernel.decode_attention(q[:num_decodes], *apart, tables[:num_decodes], lens_t[:num_decodes],
                                expected[:num_decodes], scale)
    if chunks:
        kernel.prefill_attention(q, *apart, tables, lens_t, starts, num_decodes, expected, scale)
    assert out.shape == (tokens, heads * head_dim)
    assert torch.equal(out, expected.view(tokens, -1))
    assert torch.equal(caches[0], apart[0]) and torch.equal(caches[1], apart[1])
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match="num_decodes"):
        kernel.attend_step(q, k + 1, v + 1, *caches, None, None, slots, tables, lens_t, starts, len(lens) + 1, scale)
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])  # refused before any store


@pytest.mark.parametrize(
    "dtype,quantized,heads,kv_heads,head_dim,block_size",
    [
        (torch.bfloat16, False, 9, 3, 64, 16),  # SmolLM2's: AMX scores and prefill
        (torch.float32, False, 9, 3, 64, 16),
        (torch.bfloat16, False, 6, 2, 30, 5),  # rows widened, the portable prefill
        (torch.bfloat16, True, 9, 3, 64, 16),  # int8 codes side by side, their scales apart
    ],
)
def test_caches_with_each_blocks_k_and_v_side_by_side_give_the_same_bits(kernel, dtype, quantized, heads, kv_heads,
                                                                         head_dim, block_size):
    """The engine's caches (KVCacheSpec.allocate: a block's V right after its K, views of one buffer) store and
    attend exactly as caches of their own do, in the kernels and in torch's write_kv."""
    gen = torch.Generator().manual_seed(block_size + quantized)
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, dtype, quantized=quantized)
    lens, q_lens = [40, 7, 300, 65], [1, 1, 50, 65]  # two decodes, then two prompt chunks
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 1
    side = spec.allocate(num_blocks)[0]
    assert side.v.data_ptr() - side.k.data_ptr() == block_size * kv_heads * head_dim * side.k.element_size()
    assert side.k.stride(0) == 2 * block_size * kv_heads * head_dim and not side.k.is_contiguous()
    for cache in side[:2]:
        if quantized:
            cache.copy_(torch.randint(-127, 128, cache.shape, generator=gen))
        else:
            cache.copy_(torch.randn(cache.shape, generator=gen))
    for scales in side[2:] if quantized else []:
        scales.copy_(torch.rand(scales.shape, generator=gen) / 50)
    apart = KVCache(*(c if c is None else c.clone() for c in side))
    assert apart.k.is_contiguous()
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: len(lens) * max_blocks].view(len(lens), -1)
    starts = torch.tensor([0] + q_lens).cumsum(0)
    tokens = int(starts[-1])
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                          for i, (n, ctx) in enumerate(zip(q_lens, lens)) for p in range(ctx - n, ctx)])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.view(tokens, -1, head_dim).split_with_sizes([heads, kv_heads, kv_heads], dim=1)
    lens_t, scale = torch.tensor(lens), head_dim**-0.5
    outs = [kernel.attend_step(q, k, v, *caches, slots, tables, lens_t, starts, 2, scale) for caches in (side, apart)]
    assert torch.equal(outs[0], outs[1])
    assert all(a is None or torch.equal(a, b) for a, b in zip(side, apart))
    write_kv(side, k + 1, v - 1, slots)
    write_kv(apart, k + 1, v - 1, slots)
    assert all(a is None or torch.equal(a, b) for a, b in zip(side, apart))
