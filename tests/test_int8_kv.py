"""The int8 KV cache (kv_cache_dtype "int8"): the kernels quantize rows as the torch reference does, bit for bit,
attend over int8 caches as the obvious attention does over their dequantized values, and an engine on it keeps
every request's output the same in any batch mix."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import drive, make_engine, random_workload, torch_threads
from test_attention import obvious_chunk, obvious_decode

from loom.config import CacheConfig
from loom.engine.kv_cache import KVCacheSpec
from loom.model.attention import KVCache, write_kv
from loom.model.kernels import load_paged_attention
from loom.model.kv_quant import dequantize_heads, quantize_heads


@pytest.fixture(scope="module")
def kernel():
    module = load_paged_attention()
    assert module is not None, "the C++ kernel must build on the CI machine"
    return module


def int8_caches(gen, num_blocks, block_size, kv_heads, head_dim):
    """Random K and V quantized: (codes, scales) each, and their values dequantized, float32."""
    caches = [quantize_heads(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen))
              for _ in range(2)]
    return caches, [dequantize_heads(*c) for c in caches]


def test_quantized_rows_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 3, 50).view(50, 1, 1)
    x[7, 1] = 0  # a row of zeros: scale 0, codes 0
    codes, scales = quantize_heads(x)
    assert codes.dtype == torch.int8 and scales.shape == (50, 3)
    assert codes.abs().amax(-1)[scales > 0].eq(127).all()  # each row's largest value takes the full range
    assert scales[7, 1] == 0 and codes[7, 1].eq(0).all()
    error = (dequantize_heads(codes, scales) - x).abs()
    assert (error <= scales.unsqueeze(-1) * 0.5001).all()


@pytest.mark.parametrize("tokens", [9, 600])  # 600: the rows split between two threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_quantizes_rows_as_the_reference(kernel, dtype, tokens):
    """Strided k/v views of a fused qkv row land at their slots with the reference's codes and scales."""
    gen = torch.Generator().manual_seed(1)
    blocks, block_size, kv_heads, head_dim = 160, 4, 3, 64
    qkv = (torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=gen) * 4).to(dtype)
    qkv[2, 9 * head_dim : 10 * head_dim] = 0  # one head's K row of zeros
    k = qkv[:, 9 * head_dim : (9 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (9 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]

    def empty():
        shape = (blocks, block_size, kv_heads, head_dim)
        return KVCache(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
                       torch.zeros(shape[:3]), torch.zeros(shape[:3]))

    ours, torchs = empty(), empty()
    with torch_threads(2):
        kernel.write_kv(k, v, ours.k, ours.v, slots, ours.k_scales, ours.v_scales)
    write_kv(torchs, k, v, slots)
    for a, b in zip(ours, torchs):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="int8 cache needs|float32"):
        kernel.write_kv(k, v, ours.k, ours.v, slots)  # no scales


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,block_size",
    [
        (torch.float32, 9, 3, 64, 16),
        (torch.float32, 6, 2, 30, 5),  # a head size of part vectors
        (torch.bfloat16, 9, 3, 64, 16),  # SmolLM2's shape
        (torch.bfloat16, 8, 2, 128, 8),
    ],
)
def test_decode_kernel_attends_the_dequantized_values(kernel, dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads + head_dim)
    lens = torch.tensor([1, 2, block_size + 1, 37, 300, 600, 1100])  # 600, 1100: contexts attended in chunks
    max_blocks = int(-(-lens.max() // block_size)) + 1
    num_blocks = len(lens) * max_blocks + 1
    (k_int8, v_int8), (keys, values) = int8_caches(gen, num_blocks, block_size, kv_heads, head_dim)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks) + 1
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    kernel.decode_attention(q, k_int8[0], v_int8[0], tables, lens, out, scale, k_int8[1], v_int8[1])
    expected = obvious_decode(q, keys, values, tables, lens, scale)
    # float32: AVX-512 VNNI CPUs take a path that rounds q to int16 (2^-16 of each head's largest value) for its
    # integer dot products with the key codes, a little above float32's own rounding.
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    for rows in (slice(4, 6), slice(5, 6)):  # the same bits in a smaller batch
        few = torch.full_like(q[rows], float("nan"))
        kernel.decode_attention(q[rows].contiguous(), k_int8[0], v_int8[0], tables[rows], lens[rows], few, scale,
                                k_int8[1], v_int8[1])
        assert torch.equal(few, out[rows])


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block_size",
                         [(torch.float32, 9, 3, 64, 16), (torch.float32, 6, 2, 30, 5),
                          (torch.bfloat16, 9, 3, 64, 16),  # on AMX where the CPU has it
                          (torch.bfloat16, 4, 4, 32, 4)])
def test_prefill_kernel_attends_the_dequantized_values(kernel, dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    chunks = [(1, 1), (37, 37), (45, 300), (100, 100), (5, 700)]  # (query tokens, context)
    lens, q_lens = [ctx for _, ctx in chunks], [n for n, _ in chunks]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    max_blocks = -(-max(lens) // block_size) + 1
    num_blocks = len(lens) * max_blocks + 1
    (k_int8, v_int8), (keys, values) = int8_caches(gen, num_blocks, block_size, kv_heads, head_dim)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks) + 1
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    kernel.prefill_attention(q, k_int8[0], v_int8[0], tables, torch.tensor(lens), starts, 0, out, scale, k_int8[1],
                             v_int8[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(len(lens)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected = obvious_chunk(q[rows], keys[tables[i]].flatten(0, 1)[: lens[i]],
                                 values[tables[i]].flatten(0, 1)[: lens[i]], scale)
        torch.testing.assert_close(out[rows].float(), expected, atol=tol, rtol=tol)


def test_int8_cache_holds_about_twice_the_tokens():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    int8 = KVCacheSpec(30, 3, 64, 16, torch.bfloat16, quantized=True)
    assert int8.bytes_per_token == 2 * 30 * 3 * (64 + 4) and spec.bytes_per_token == 2 * 30 * 3 * 128
    assert int8.num_blocks_for_memory(1 << 30) > 1.8 * spec.num_blocks_for_memory(1 << 30)
    cache = int8.allocate(4)[0]
    assert cache.k.dtype == torch.int8 and cache.k_scales.shape == (4, 16, 3) and cache.v_scales.dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("backend", ["paged", "sdpa", "reference"])
def test_int8_engine_gives_each_request_its_alone_output_in_any_mix(tiny_llama, backend):
    rng = random.Random(11)
    workload = random_workload(rng, 8, tiny_llama.config.vocab_size)
    alone = make_engine(tiny_llama, max_num_seqs=1, prefix_caching=False, kv_cache_dtype="int8", backend=backend)
    expected = [drive(alone, [request], [0])[0] for request in workload]
    for max_num_seqs, budget, block_size in ((3, 16, 4), (8, 64, 16)):
        engine = make_engine(tiny_llama, max_num_seqs, budget, block_size=block_size, kv_cache_dtype="int8",
                             backend=backend)
        assert engine.runner.kv_caches[0].k.dtype == torch.int8
        done = drive(engine, workload, [rng.randint(0, 10) for _ in workload])
        assert [done[i] for i in range(len(workload))] == expected
        assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_the_command_line_asks_for_an_int8_cache():
    from loom.cli import build_parser
    from loom.engine_args import engine_config

    for command in (["serve"], ["bench", "offline"]):
        assert engine_config(build_parser().parse_args([*command, "--kv-cache-dtype", "int8"]),
                             dtype="bfloat16", quantization="none").cache.kv_cache_dtype == "int8"
        assert engine_config(build_parser().parse_args(command), dtype="bfloat16",
                             quantization="none").cache.kv_cache_dtype == "auto"
    assert build_parser().parse_args(["bench", "perf", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
