"""The fused layer-op kernels against the torch ops they replace (which follow transformers op for op)."""

from __future__ import annotations

import pytest
import torch

from loom.model.layer_ops import FusedLayerOps, TorchLayerOps, make_layer_ops
from loom.model.linear import SiluMulAfter, make_matmul
from loom.model.llama import AMX_MLP_CHUNK_ROWS_PER_THREAD, MLP_CHUNK_ROWS_PER_THREAD


@pytest.fixture(scope="module")
def fused() -> FusedLayerOps:
    ops = make_layer_ops("auto")
    assert isinstance(ops, FusedLayerOps), "the fused layer ops must build on the CI machine"
    return ops


def close_to_torch(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: within a few ulps (summation order, fused multiply-adds). bfloat16: torch's bits, except where a
    norm's float32 mean, summed in another order, tips a rounding the other way (one step, then the weight's)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=4e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=0)
        assert (got != expected).float().mean().item() < 1e-3


# rows: one decode row, a few, more than one work item per thread; widths: SmolLM2's hidden size and odd ones.
ROWS = [1, 7, 64, 300]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 37])
def test_add_rms_norm_matches_torch(fused, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * 100 + width)
    hidden = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    expected_hidden, expected = TorchLayerOps().add_rms_norm(hidden, delta, weight, 1e-5)

    ours = hidden.clone()
    got_hidden, got = fused.add_rms_norm(ours, delta, weight, 1e-5)
    assert got_hidden is ours, "the residual stream is updated in place"
    assert torch.equal(got_hidden, expected_hidden), "the residual add rounds as torch's add does"
    close_to_torch(got, expected)

    unchanged = hidden.clone()
    _, got = fused.add_rms_norm(unchanged, None, weight, 1e-5)
    assert torch.equal(unchanged, hidden)
    close_to_torch(got, TorchLayerOps().add_rms_norm(hidden, None, weight, 1e-5)[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [640, 37])
def test_gemma_rms_norm_matches_torch_on_rows_and_on_each_head(fused, dtype, rows, width):
    """Rows [T, D] by (1 + weight) [D]; and the q and k heads of a fused qkv row, read in place as [T, G, D] (rows
    and heads apart in memory) by a weight for each head."""
    gen = torch.Generator().manual_seed(rows * 10 + width)
    x = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
    weight = 1 + 0.3 * torch.randn(width, generator=gen)
    close_to_torch(fused.gemma_rms_norm(x, weight, 1e-6), TorchLayerOps().gemma_rms_norm(x, weight, 1e-6))
    qkv = torch.randn(rows, 7 * width, generator=gen).to(dtype)
    heads = qkv[:, : 5 * width].view(rows, 5, width)
    head_weights = 1 + 0.3 * torch.randn(5, width, generator=gen)
    got = fused.gemma_rms_norm(heads, head_weights, 1e-6)
    assert got.is_contiguous()
    close_to_torch(got, TorchLayerOps().gemma_rms_norm(heads, head_weights, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_gemma_add_rms_norm_matches_torch_and_updates_hidden_in_place(fused, dtype, rows):
    """The residual add of a sublayer's normed output and the next sublayer's norm, in one pass: the bits of the
    fused norm followed by torch's add, hidden updated in place; no second norm without its weight."""
    gen = torch.Generator().manual_seed(rows)
    hidden = (3 * torch.randn(rows, 640, generator=gen)).to(dtype)
    delta = (5 * torch.randn(rows, 640, generator=gen)).to(dtype)
    delta_weight, weight = 1 + torch.randn(640, generator=gen), 1 + torch.randn(640, generator=gen)
    want_hidden = hidden + fused.gemma_rms_norm(delta, delta_weight, 1e-6)
    want_next = fused.gemma_rms_norm(want_hidden, weight, 1e-6)
    same_stream = hidden.clone()
    got_hidden, got_next = fused.gemma_add_rms_norm(same_stream, delta, delta_weight, weight, 1e-6)
    assert got_hidden is same_stream and torch.equal(got_hidden, want_hidden) and torch.equal(got_next, want_next)
    close_to_torch(got_next, TorchLayerOps().gemma_add_rms_norm(hidden, delta, delta_weight, weight, 1e-6)[1])
    last_hidden, nothing = fused.gemma_add_rms_norm(hidden.clone(), delta, delta_weight, None, 1e-6)
    assert nothing is None and torch.equal(last_hidden, want_hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [64, 48])  # 48: not whole 16-lane halves, so AVX-512 builds take the scalar code
def test_rotate_qk_matches_torch(fused, dtype, rows, head_dim):
    gen = torch.Generator().manual_seed(rows)
    heads, width = 12, 15 * head_dim  # SmolLM2: 9 q + 3 k heads rotated, 3 v heads left alone
    qkv = torch.randn(rows, width, generator=gen).to(dtype)
    angles = torch.randn(rows, head_dim, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = TorchLayerOps().rotate_qk(qkv, cos, sin, heads, head_dim)

    got = fused.rotate_qk(qkv.clone(), cos, sin, heads, head_dim)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected), "each product and the sum are rounded where torch rounds them"
    close_to_torch(got, expected)
    assert torch.equal(got[:, heads * head_dim :], qkv[:, heads * head_dim :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 13])
def test_silu_mul_matches_torch(fused, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * 100 + width)
    gate_up = (4 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    expected = TorchLayerOps().silu_mul(gate_up)
    got = fused.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    close_to_torch(got, expected)


def test_silu_next_to_a_bfloat16_midpoint_rounds_as_torch_rounds_it(fused):
    """SiLU(5.9375) is 5.92187444, just under the bfloat16 midpoint 5.921875: a float32 result one ulp high (as GCC's
    vectorised expf gave on AVX-512) rounds up to 5.9375 where torch gives 5.90625."""
    gate_up = torch.cat([torch.full((3, 64), 5.9375), torch.ones(3, 64)], dim=1).bfloat16()
    got = fused.silu_mul(gate_up)
    assert torch.equal(got, TorchLayerOps().silu_mul(gate_up))
    assert got[0, 0].item() == 5.90625


def every_finite_bfloat16() -> torch.Tensor:
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return values[values.float().isfinite()]


def test_silu_mul_gives_torchs_bits_for_every_bfloat16_gate(fused):
    """Every finite bfloat16 gate, SiLU far below e^x's overflow (-0 there, not NaN) and near bfloat16 midpoints
    included, times an up of 1 and of 3: torch's bits, value for value."""
    gate = every_finite_bfloat16().view(-1, 32)
    for up_value in (1.0, 3.0):
        gate_up = torch.cat([gate, torch.full_like(gate, up_value)], dim=1)
        got = fused.silu_mul(gate_up)
        assert not got.isnan().any()
        assert torch.equal(got, TorchLayerOps().silu_mul(gate_up))


def test_gelu_tanh_mul_gives_torchs_bits_for_every_bfloat16_gate(fused):
    """GeGLU's bfloat16 product by the table: every finite bfloat16 gate (rows of 64: whole vectors of torch's loop),
    times an up of 1 and of 3, and random rows as wide as Gemma 3 270M's MLP: torch's bits."""
    gate = every_finite_bfloat16().view(-1, 64)
    for up_value in (1.0, 3.0):
        gate_up = torch.cat([gate, torch.full_like(gate, up_value)], dim=1)
        assert torch.equal(fused.kernel.bf16_table_mul(gate_up, fused.bf16_gelu_tanh_table),
                           TorchLayerOps().gelu_tanh_mul(gate_up))
    gen = torch.Generator().manual_seed(7)
    for rows in ROWS:
        gate_up = (4 * torch.randn(rows, 2 * 2048, generator=gen)).bfloat16()
        assert torch.equal(fused.gelu_tanh_mul(gate_up), TorchLayerOps().gelu_tanh_mul(gate_up))


def test_float32_silu_is_within_a_few_ulp(fused):
    """The float32 SiLU (its own e^x) against SiLU in double; and 0 where torch's e^-x overflows float32."""
    gate = torch.linspace(-88.5, 100, 200_001)
    got = fused.silu_mul(torch.stack([gate, torch.ones_like(gate)], dim=1))[:, 0]
    exact = gate.double() / (1 + torch.exp(-gate.double()))
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert not got.isnan().any()
    assert ((got.double() - exact).abs() <= 4 * ulp).all()
    beyond = -torch.linspace(88.75, 1000, 101)
    assert torch.equal(fused.silu_mul(torch.stack([beyond, torch.ones_like(beyond)], dim=1))[:, 0],
                       torch.zeros_like(beyond))


def test_fused_ops_reject_what_they_cannot_run(fused):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        fused.silu_mul(torch.zeros(8, 4).t())
    with pytest.raises(RuntimeError, match="weight must be"):
        fused.add_rms_norm(torch.zeros(2, 8), None, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="cos and sin"):
        fused.rotate_qk(torch.zeros(2, 64), torch.zeros(2, 16), torch.zeros(2, 16), 2, 32)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        fused.gemma_rms_norm(torch.zeros(2, 3, 8), torch.ones(8), 1e-6)  # one weight per head needed
    with pytest.raises(RuntimeError, match="last dimension contiguous"):
        fused.gemma_rms_norm(torch.zeros(8, 4).t(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weights must be float32"):
        fused.gemma_add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up must be bfloat16"):
        fused.kernel.bf16_table_mul(torch.zeros(2, 128), fused.bf16_gelu_tanh_table)
    with pytest.raises(RuntimeError, match="table must be"):
        fused.kernel.bf16_table_mul(torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.bfloat16))


def test_unknown_layer_ops_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown layer ops"):
        make_layer_ops("fast")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mlp_in_row_chunks_gives_the_same_bits(tiny_llama, dtype):
    """A step's MLP goes mlp_chunk_rows_per_thread rows a thread at a time (so its intermediate stays in L2, or the
    AMX matmul's weights are dequantized fewer times); each row's result is its own, so two whole chunks and a part
    give the bits of one pass over all of them."""
    model = tiny_llama.build(dtype, make_matmul("auto", "auto", dtype), make_layer_ops("auto"))
    layer = model.layers[0]
    gen = torch.Generator().manual_seed(0)
    chunk_rows = model.mlp_chunk_rows_per_thread * torch.get_num_threads()
    x = torch.randn(2 * chunk_rows + 88, tiny_llama.config.hidden_size, generator=gen).to(dtype)
    assert torch.equal(model.mlp(layer, x), layer.down(layer.gate_up(x)))


def test_mlp_chunks_are_longer_where_silu_mul_is_the_amx_epilogue(tiny_llama):
    """1024 rows a thread where SiLU x up is the AMX matmul's epilogue; 256 where it is a pass of its own."""
    float32 = tiny_llama.build(torch.float32, make_matmul("auto", "auto", torch.float32), make_layer_ops("auto"))
    assert isinstance(float32.layers[0].gate_up, SiluMulAfter)
    assert float32.mlp_chunk_rows_per_thread == MLP_CHUNK_ROWS_PER_THREAD
    matmul = make_matmul("auto", "auto", torch.bfloat16)
    if matmul.amx_kernel is None:
        pytest.skip("no AMX on this CPU")
    bfloat16 = tiny_llama.build(torch.bfloat16, matmul, make_layer_ops("auto"))
    assert not isinstance(bfloat16.layers[0].gate_up, SiluMulAfter)
    assert bfloat16.mlp_chunk_rows_per_thread == AMX_MLP_CHUNK_ROWS_PER_THREAD
