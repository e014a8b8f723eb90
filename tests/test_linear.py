"""The packed CPU matmul kernel against a float64 reference and torch's F.linear, and its batch invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.model.linear import MatmulBackend, PackedLinear, TorchLinear, make_matmul, pack_panels, pad_to_panels


@pytest.fixture(scope="module")
def packed() -> MatmulBackend:
    backend = make_matmul("auto")
    if backend.kernel is None:
        pytest.skip("the packed linear kernel does not build on this machine (needs a compiler and AVX2)")
    return backend


# (rows, in_features, out_features): full 6-row tiles and partial ones (1-3 rows span several panels), a partial
# last panel, several blocks of rows (256 KB of x each: 42 rows at 1536 features), odd feature counts, no rows.
SHAPES = [(1, 64, 48), (1, 20, 41), (2, 40, 70), (3, 33, 49), (6, 576, 960), (7, 17, 23), (13, 100, 257), (97, 64, 33),
          (200, 1536, 40), (200, 31, 16), (0, 8, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), SHAPES)
def test_packed_linear_matches_reference(packed, dtype, rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    linear = packed.linear(weight, bias)
    assert type(linear) is PackedLinear

    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    exact = F.linear(x.double(), weight.double(), bias.double())
    ours = (got.double() - exact).abs().max().item() if rows else 0.0
    torchs = (F.linear(x, weight, bias).double() - exact).abs().max().item() if rows else 0.0
    # float32: summation order only (~1e-6 relative); bfloat16: one rounding of the output, as torch does.
    tolerance = 1e-4 * in_features**0.5 if dtype == torch.float32 else 2 * torchs + 1e-2
    assert ours <= tolerance, (ours, torchs)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features"), [(1, 48), (5, 41), (13, 257)])
def test_bfloat16_results_are_rounded_as_torch_rounds_them(packed, weight_dtype, rows, out_features):
    """bfloat16 rows in, bfloat16 out: the same bits as the float32 kernel's result (bias included) rounded by torch,
    so rounding inside the kernel changed nothing but where it happens."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, 96, generator=gen).to(weight_dtype)
    bias = pad_to_panels(torch.randn(out_features, generator=gen).bfloat16())
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    x[0, :3] = torch.tensor([1e-30, -3e38, 0.0])  # tiny, huge and zero inputs
    panels = pack_panels(weight)
    for b in (None, bias):
        got = packed.kernel.packed_linear(x, panels, out_features, b)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, packed.kernel.packed_linear(x.float(), panels, out_features, b).bfloat16())


def test_packed_linear_keeps_leading_dimensions(packed):
    weight = torch.randn(40, 24)
    x = torch.randn(3, 5, 24)
    assert torch.allclose(packed.linear(weight)(x), F.linear(x, weight), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_rows_do_not_depend_on_the_batch(packed, dtype):
    """A row's result is bit-identical alone, in any position of a batch, and in a batch of any size."""
    gen = torch.Generator().manual_seed(0)
    linear = packed.linear(torch.randn(70, 1536, generator=gen).to(dtype))
    batch = torch.randn(131, 1536, generator=gen).to(dtype)  # blocks of 42 rows
    together = linear(batch)
    for i in (0, 5, 6, 41, 42, 130):
        assert torch.equal(linear(batch[i : i + 1]), together[i : i + 1])
    assert torch.equal(linear(batch[3:10]), together[3:10])
    assert torch.equal(linear(batch.flip(0)), together.flip(0))


def test_bfloat16_panels_are_stored_in_the_kernels_column_order():
    weight = torch.arange(32 * 2, dtype=torch.float32).view(32, 2)
    f32 = pack_panels(weight)
    assert f32.shape == (2, 2, 16) and torch.equal(f32[1, 0], weight[16:, 0])
    bf16 = pack_panels(weight.bfloat16())
    assert bf16[0, 0].float().tolist() == [0, 2, 4, 6, 16, 18, 20, 22, 8, 10, 12, 14, 24, 26, 28, 30]


def test_packed_linear_rejects_a_wrong_input_width(packed):
    with pytest.raises(RuntimeError, match="features"):
        packed.kernel.packed_linear(torch.randn(2, 5), pack_panels(torch.randn(16, 4)), 16)
    with pytest.raises(RuntimeError, match="bias"):
        packed.kernel.packed_linear(torch.randn(2, 4), pack_panels(torch.randn(20, 4)), 20, torch.zeros(20))


def test_torch_backend_and_sliced_output_head():
    backend = make_matmul("torch")
    weight = torch.randn(5000, 32)
    x = torch.randn(4, 32)
    assert isinstance(backend.linear(weight), TorchLinear)
    head = backend.output_head(weight)
    assert head.cpu_slice_rows is not None and head.out_features > head.cpu_slice_rows
    assert torch.allclose(head(x), F.linear(x, weight), atol=1e-5)


def test_unknown_matmul_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="matmul backend"):
        make_matmul("blas")


def test_placing_weights_in_one_buffer_moves_their_bytes_not_their_results(packed):
    """A model's matmuls, their weights moved into one buffer in forward order at page boundaries: each gives the
    same bits as before, from views of that one buffer, in that order."""
    from loom.model.linear import PAGE_BYTES, SiluMulAfter, place_in_one_buffer

    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(out, 64, generator=gen).bfloat16() for out in (96, 40, 256)]
    linears = [packed.linear(weights[0]), TorchLinear(weights[1]),
               SiluMulAfter(packed.linear(weights[2]), lambda gate_up: gate_up)]
    x = torch.randn(5, 64, generator=gen).bfloat16()
    before = [linear(x) for linear in linears]
    place_in_one_buffer(linears)
    assert all(torch.equal(linear(x), want) for linear, want in zip(linears, before))
    placed = [linears[0].panels, linears[1].weight, linears[2].product.panels]
    starts = [t.data_ptr() for t in placed]
    assert len({t.untyped_storage().data_ptr() for t in placed}) == 1  # one buffer
    assert starts == sorted(starts) and all(s % PAGE_BYTES == 0 for s in starts)
