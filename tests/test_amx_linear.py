"""The AMX bfloat16 matmul kernel against a float64 reference, its batch invariance, its reads of x (no further than
x's last row), its tile layout, GGUF blocks dequantized into its tiles (the bits of their bfloat16 weights), and how
the matmul backend chooses it. Kernel tests skip on CPUs without AMX-BF16; the layout and choice tests run anywhere."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import random_quantized, torch_threads

from loom import LLM, SamplingParams
from loom.model.kernels import load_amx_linear
from loom.model.layer_ops import TorchLayerOps, make_layer_ops
from loom.model.linear import (
    AmxLinear,
    AmxQuantizedLinear,
    AmxQuantizedSiluMulLinear,
    AmxSiluMulLinear,
    PackedLinear,
    SiluMulAfter,
    interleave_gate_up,
    make_matmul,
    pack_amx_tiles,
)
from loom.model.quantized import concat_rows


@pytest.fixture(scope="module")
def amx():
    backend = make_matmul("auto", "none", torch.bfloat16)
    if backend.amx_kernel is None:
        pytest.skip("no AMX-BF16 on this CPU (or Linux did not grant the tile state)")
    return backend


def test_tiles_hold_each_columns_k_pairs():
    """Tile (p, c), row r, lanes 2n and 2n + 1: W[16p + n, 32c + 2r] and W[16p + n, 32c + 2r + 1]; zero padding."""
    # Distinct bit patterns (normal positive numbers), so every weight tells where it came from.
    weight = (torch.arange(20 * 40, dtype=torch.int16) + 0x3000).view(20, 40).view(torch.bfloat16)
    tiles = pack_amx_tiles(weight)
    assert tiles.shape == (2, 2, 16, 32)
    places = [(0, 0, 0, 0), (0, 0, 3, 5), (1, 0, 7, 3), (0, 1, 3, 15), (1, 1, 2, 1), (1, 1, 7, 5), (1, 0, 0, 4)]
    for p, c, r, n in places:
        for j in (0, 1):
            row, col = 16 * p + n, 32 * c + 2 * r + j
            expected = weight[row, col] if row < 20 and col < 40 else 0
            assert tiles[p, c, r, 2 * n + j] == expected, (p, c, r, n, j)


# (rows, in_features, out_features): one row (decode), partial 16-row blocks and panels, a k that is not whole
# 32-wide chunks (x copied, zero-padded), more rows than one pass over the weights (256), SmolLM2's shapes, no rows.
SHAPES = [(1, 576, 960), (3, 30, 5), (17, 576, 576), (33, 100, 37), (64, 1536, 576), (300, 64, 48),
          (600, 576, 200), (0, 64, 16)]


@pytest.mark.parametrize(("rows", "in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_matches_reference(amx, rows, in_features, out_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    linear = amx.linear(weight, bias)
    assert isinstance(linear, AmxLinear)
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    if not rows:
        return
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # float32 sums of exact bfloat16 products, then one rounding to bfloat16: within an output ulp or two.
    assert ((got.double() - exact).abs() <= exact.abs() / 128 + 1e-3 * in_features**0.5).all()
    torchs = (F.linear(x, weight, bias).double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2 * torchs + 1e-2


@pytest.mark.parametrize("out_features", [70, 96])
def test_amx_rows_do_not_depend_on_the_batch(amx, out_features):
    """A row's result is bit-identical alone, in any position of a batch, and in batches of any size (several 16-row
    tiles, a partial one, more than one 256-row pass; 96 outputs are whole panel triples, so one row block goes with
    two panels a group and more row blocks with three; 70 outputs keep 2 x 2 groups)."""
    gen = torch.Generator().manual_seed(0)
    linear = amx.linear(torch.randn(out_features, 1536, generator=gen).bfloat16())
    batch = torch.randn(300, 1536, generator=gen).bfloat16()
    together = linear(batch)
    for i in (0, 5, 15, 16, 31, 32, 255, 256, 299):
        assert torch.equal(linear(batch[i : i + 1]), together[i : i + 1])
    for lo, hi in [(3, 10), (0, 17), (40, 73), (100, 300)]:
        assert torch.equal(linear(batch[lo:hi]), together[lo:hi])
    assert torch.equal(linear(batch.flip(0)), together.flip(0))


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_rows_split_among_threads_give_every_row_its_bits(amx, threads):
    """Where each thread gets a whole 256-row pass, threads split the rows rather than the panels (a prefill, a big
    MLP chunk): every row keeps the bits it gets in a batch of a few rows, in dense tiles and GGUF blocks, with 2 x 2
    groups (70 outputs) and panel triples (96), and through the SiLU epilogue. 1100 rows: 69 row blocks, the last
    one partial, in runs of 17 to 35 blocks a thread on 2 to 4 threads (on one thread, as before). Split rows go
    against ranges of panels, k in slices of 18 chunks: 1536 features take three slices (the sums resumed) and
    ranges of 12 panels (400 outputs: two whole ranges, then one of one panel; 17 row block pairs on the first of
    two threads, so that a range's last group waits to be rounded while the next range's first groups run), 600
    features a padded copy of x and a one-chunk slice, and a gate/up of 2 x 320 outputs two ranges through the SiLU
    epilogue."""
    gen = torch.Generator().manual_seed(threads)
    gguf = make_matmul("auto", "gguf", torch.bfloat16)
    silu_mul = make_layer_ops("auto").silu_mul
    cases = []
    for in_features in (576, 1536, 600):
        batch = torch.randn(1100, in_features, generator=gen).bfloat16()
        cases += [(batch, amx.linear(torch.randn(70, in_features, generator=gen).bfloat16())),
                  (batch, amx.linear(torch.randn(400, in_features, generator=gen).bfloat16()))]
        if in_features % 32 == 0:
            quantized, dense = random_quantized("q4_1", 400 if in_features > 576 else 96, in_features, seed=threads)
            cases.append((batch, gguf.linear(dense.bfloat16(), None, quantized)))
        if in_features == 576:
            for outputs in (48, 320):
                gate, up = (torch.randn(outputs, 576, generator=gen).bfloat16() for _ in range(2))
                cases.append((batch, amx.silu_mul_linear(gate, up, None, None, silu_mul)))
    for batch, linear in cases:
        few = torch.cat([linear(rows) for rows in batch.split(40)])
        with torch_threads(threads):
            assert torch.equal(linear(batch), few), (type(linear).__name__, batch.shape[1])


# Run in a child process, which a read past x kills with SIGSEGV: x of 3 rows ends exactly where an unreadable page
# begins, then goes through the dense and the GGUF-block AMX matmuls.
READS_STOP_AT_X = r"""
import ctypes, mmap, sys
import torch
from loom.model.linear import make_matmul
sys.path.insert(0, sys.argv[1])
from conftest import random_quantized

rows, in_features, out_features = 3, 576, 96
page = mmap.PAGESIZE
memory = mmap.mmap(-1, 2 * page)
start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
if ctypes.CDLL(None).mprotect(ctypes.c_void_p(start + page), ctypes.c_size_t(page), 0) != 0:  # PROT_NONE
    sys.exit("mprotect failed")
nbytes = rows * in_features * 2
x = torch.frombuffer(memory, dtype=torch.bfloat16, count=rows * in_features, offset=page - nbytes)
x = x.view(rows, in_features)
x.copy_(torch.randn(rows, in_features).bfloat16())
quantized, dense = random_quantized("q4_1", out_features, in_features, seed=0)
for linear in (make_matmul("auto", "none", torch.bfloat16).linear(dense.bfloat16()),
               make_matmul("auto", "gguf", torch.bfloat16).linear(dense.bfloat16(), None, quantized)):
    assert torch.equal(linear(x), linear(x.clone())), type(linear).__name__
print("read up to x's last row")
"""


def test_amx_reads_x_of_few_rows_no_further_than_its_last_row(amx):
    """x of fewer than 16 rows is read in place by tiles of just its rows: a 16-row tile would read past its end."""
    done = subprocess.run([sys.executable, "-c", READS_STOP_AT_X, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "read up to" in done.stdout


def test_amx_linear_keeps_leading_dimensions_and_rejects_bad_inputs(amx):
    weight = torch.randn(40, 64).bfloat16()
    linear = amx.linear(weight)
    x = torch.randn(3, 5, 64).bfloat16()
    assert torch.equal(linear(x), linear(x.view(15, 64)).view(3, 5, 40))
    with pytest.raises(RuntimeError, match="bfloat16"):
        linear(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="features"):
        linear(torch.randn(2, 100).bfloat16())


def test_gate_and_up_interleave_in_eights():
    gate, up = torch.arange(16).view(16, 1), 100 + torch.arange(16).view(16, 1)
    rows = interleave_gate_up(gate, up).flatten().tolist()
    assert rows == [*range(8), *range(100, 108), *range(8, 16), *range(108, 116)]


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_mul_in_the_amx_epilogue_gives_the_bits_of_the_product_then_silu_mul(amx, rows, with_bias):
    """SwiGLU's gate/up on AMX ends in SiLU(gate) * up as each panel is stored: the bits of the plain product rounded
    to bfloat16 and then torch's F.silu(gate) * up (the fused layer op's bits too); partial row blocks, one row, more
    than a 256-row pass."""
    gen = torch.Generator().manual_seed(rows)
    inter, hidden = 96, 576
    gate, up = ((torch.randn(inter, hidden, generator=gen) / 8).bfloat16() for _ in range(2))
    bias = torch.randn(2 * inter, generator=gen).bfloat16() if with_bias else None
    fused_ops = make_layer_ops("auto")
    gated = amx.silu_mul_linear(gate, up, bias, None, fused_ops.silu_mul)
    assert isinstance(gated, AmxSiluMulLinear)
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    product = amx.linear(torch.cat([gate, up]), bias)(x)
    got = gated(x)
    assert got.shape == (rows, inter)
    assert torch.equal(got, TorchLayerOps().silu_mul(product))
    assert torch.equal(got, fused_ops.silu_mul(product))
    # The product alone (for the matmul-only timings) is the same matmul, its columns interleaved.
    assert torch.equal(gated.product(x), interleave_gate_up(*product.t().chunk(2)).t())


def test_the_amx_epilogue_keeps_denormal_products(amx):
    """Gates and ups so small that SiLU(gate) * up is a float32 denormal: rounded to bfloat16 as torch rounds it
    (kept, not taken as zero as VCVTNEPS2BF16 would), by the AMX epilogue and by the fused layer op."""
    gen = torch.Generator().manual_seed(0)
    inter, hidden, rows = 96, 576, 40
    gate = (torch.randn(inter, hidden, generator=gen) * 1e-21).bfloat16()
    up = (torch.randn(inter, hidden, generator=gen) * 1e-20).bfloat16()
    fused_ops = make_layer_ops("auto")
    gated = amx.silu_mul_linear(gate, up, None, None, fused_ops.silu_mul)
    assert isinstance(gated, AmxSiluMulLinear)
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    product = amx.linear(torch.cat([gate, up]), None)(x)
    expected = TorchLayerOps().silu_mul(product)
    tiny = expected.float().abs()
    assert ((tiny > 0) & (tiny < torch.finfo(torch.float32).tiny)).float().mean() > 0.5  # mostly denormal
    assert torch.equal(gated(x), expected)
    assert torch.equal(fused_ops.silu_mul(product), expected)  # the layer op's rounding (silu.h) too


def test_silu_mul_linear_elsewhere_is_the_product_then_the_layer_op():
    """float32 weights, and a width not a multiple of 8, run the product and then the layer op's silu_mul."""
    gen = torch.Generator().manual_seed(0)
    ops = TorchLayerOps()
    gate, up, x = (torch.randn(rows, 32, generator=gen) for rows in (12, 12, 5))
    for dtype in (torch.float32, torch.bfloat16):
        matmul = make_matmul("auto", "none", dtype)
        gated = matmul.silu_mul_linear(gate.to(dtype), up.to(dtype), None, None, ops.silu_mul)
        assert isinstance(gated, SiluMulAfter)
        assert torch.equal(gated(x.to(dtype)), ops.silu_mul(gated.product(x.to(dtype))))


def test_the_amx_epilogue_rejects_gate_and_up_in_part_panels(amx):
    linear = amx.linear(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="whole panels"):
        amx.amx_kernel.amx_silu_mul_linear(torch.randn(2, 64).bfloat16(), linear.panels, 40, None)


def test_the_backend_takes_amx_for_bfloat16_only():
    """'auto' runs bfloat16 models on AMX where the CPU has it (GGUF blocks too, through the AMX kernel; 'none'
    dequantizes them), float32 models on the other kernels; 'amx' for a float32 model is a clear error."""
    with pytest.raises(ValueError, match="bfloat16"):
        make_matmul("amx", "auto", torch.float32)
    assert make_matmul("auto", "auto", torch.float32).amx_kernel is None
    bf16 = make_matmul("auto", "auto", torch.bfloat16)
    if load_amx_linear() is None:
        assert bf16.amx_kernel is None and not bf16.amx_blocks
        with pytest.raises(RuntimeError, match="amx"):
            make_matmul("amx", "none", torch.bfloat16)
    else:
        assert bf16.amx_kernel is not None and bf16.quantized_kernel is None and bf16.amx_blocks
        assert make_matmul("auto", "gguf", torch.bfloat16).amx_blocks
        assert not make_matmul("auto", "none", torch.bfloat16).amx_blocks
        packed = make_matmul("packed", "gguf", torch.bfloat16)
        assert packed.amx_kernel is None and packed.quantized_kernel is not None


# (rows, in_features, out_features): one row, partial row blocks and panels, k beyond one 6-chunk slice (the sums
# resumed), whole panel triples (48 and 960 outputs) and 2 x 2 groups, more rows than a 256-row pass, no rows.
BLOCK_SHAPES = [(1, 576, 960), (3, 64, 40), (17, 224, 48), (33, 1536, 70), (64, 576, 96), (300, 96, 48),
                (0, 64, 16)]


# The K-quants' super-blocks are 256 weights along k.
K_QUANT_SHAPES = [(1, 512, 960), (3, 256, 40), (17, 768, 48), (64, 512, 96), (300, 256, 48), (0, 256, 16)]


@pytest.mark.parametrize(("fmt", "rows", "in_features", "out_features"),
                         [(fmt, *shape) for fmt in ("q4_0", "q4_1", "q8_0", "q5_1") for shape in BLOCK_SHAPES]
                         + [(fmt, *shape) for fmt in ("q4_k", "q5_k", "q6_k") for shape in K_QUANT_SHAPES])
def test_gguf_blocks_on_amx_give_the_bits_of_their_bfloat16_weights(amx, fmt, rows, in_features, out_features):
    """Records dequantized into tiles as the kernel goes: bit for bit AmxLinear on gguf's float32 weights rounded to
    bfloat16 (torch's rounding), with and without a bias."""
    quantized, dense = random_quantized(fmt, out_features, in_features, seed=rows * 1000 + out_features)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if rows % 2 else None
    blocks = make_matmul("auto", "gguf", torch.bfloat16).linear(dense.bfloat16(), bias, quantized)
    assert isinstance(blocks, AmxQuantizedLinear)
    got = blocks(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert torch.equal(got, amx.linear(dense.bfloat16(), bias)(x))


@pytest.mark.parametrize("rows", [1, 17, 64])
def test_gguf_gate_and_up_on_amx_give_the_dense_epilogues_bits(amx, rows):
    """SwiGLU's gate and up from GGUF blocks (their rows interleaved in 8s like the dense weights'): the bits of
    AmxSiluMulLinear on the dequantized weights, and the product alone too."""
    (gate_q, gate), (up_q, up) = (random_quantized("q4_1", 96, 576, seed) for seed in (1, 2))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    silu_mul = make_layer_ops("auto").silu_mul
    blocks = make_matmul("auto", "gguf", torch.bfloat16).silu_mul_linear(
        gate.bfloat16(), up.bfloat16(), None, concat_rows([gate_q, up_q]), silu_mul)
    dense = amx.silu_mul_linear(gate.bfloat16(), up.bfloat16(), None, None, silu_mul)
    assert isinstance(blocks, AmxQuantizedSiluMulLinear) and isinstance(dense, AmxSiluMulLinear)
    assert torch.equal(blocks(x), dense(x))
    assert torch.equal(blocks.product(x), dense.product(x))


def test_amx_blocks_reject_a_wrong_format_or_shape(amx):
    quantized, dense = random_quantized("q4_1", 16, 64, seed=1)
    blocks = make_matmul("auto", "gguf", torch.bfloat16).linear(dense.bfloat16(), None, quantized)
    kernel = amx.amx_kernel
    with pytest.raises(RuntimeError, match="features"):
        blocks(torch.randn(2, 96).bfloat16())
    with pytest.raises(RuntimeError, match="records"):
        kernel.amx_quantized_linear(torch.randn(2, 64).bfloat16(), blocks.records, "q8_0", 16)
    with pytest.raises(RuntimeError, match="format"):
        kernel.amx_quantized_linear(torch.randn(2, 64).bfloat16(), blocks.records, "q4_0", 16)
    with pytest.raises(RuntimeError, match="whole panels"):
        kernel.amx_quantized_linear(torch.randn(2, 64).bfloat16(), blocks.records, "q4_1", 12, None, True)


def test_smollm2_long_prompt_whole_or_in_chunks_gives_the_same_logprobs(smollm2, amx):
    """An 1100-token prompt prefilled in one step (the AMX matmul's threads split its rows and take the weights a
    range of panels at a time, rows_against_panel_ranges) and in 128-token chunks (threads split the panels): the
    same tokens with the same log-probabilities, bit for bit, through every layer of SmolLM2's GGUF blocks."""
    prompt = random.Random(5).choices(range(100, 40000), k=1100)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = []
    with torch_threads(2):
        for budget in (2048, 128):
            llm = LLM(loaded=smollm2, dtype="bfloat16", max_num_batched_tokens=budget, num_kv_blocks=96,
                      enable_prefix_caching=False)
            out = llm.generate([prompt], params)[0]
            outputs.append([(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs])
    assert outputs[0] == outputs[1]


def test_smollm2_bfloat16_on_amx_is_batch_invariant(smollm2, amx):
    """The whole model in bfloat16 on AMX: each request's greedy tokens are the same alone and batched with others
    (torch's own bfloat16 matmul fails this here), and the model still answers sensibly."""
    llm = LLM(loaded=smollm2, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64, quantization="none")
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].qkv, AmxLinear) and isinstance(model.lm_head, AmxLinear)
    assert isinstance(model.layers[0].gate_up, AmxSiluMulLinear)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):", "1, 2, 3, 4,"]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert batched == [llm.generate([p], params)[0].token_ids for p in prompts]
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))[0].text.startswith(" Paris")
    # The GGUF file's blocks on AMX (the default): the same tokens, from 5 bits a weight (8.5 for the head).
    blocks = LLM(loaded=smollm2, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64)
    model = blocks.engine.runner.model
    assert isinstance(model.layers[0].qkv, AmxQuantizedLinear) and model.layers[0].qkv.format == "q4_1"
    assert isinstance(model.lm_head, AmxQuantizedLinear) and model.lm_head.format == "q8_0"
    assert isinstance(model.layers[0].gate_up, AmxQuantizedSiluMulLinear)
    assert [o.token_ids for o in blocks.generate(prompts, params)] == batched
    packed = LLM(loaded=smollm2, dtype="bfloat16", num_kv_blocks=32, matmul_backend="packed", quantization="none")
    assert type(packed.engine.runner.model.layers[0].qkv) is PackedLinear
