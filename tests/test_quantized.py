"""GGUF's Q4_0 / Q4_1 / Q8_0 / K-quant / Q5_1 weights run in their blocks: the same bits as the float32 kernel on the dequantized
weights, whatever the batch; the loader keeps blocks that dequantize to its own weights; an engine on them gives
float32's outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import GGML_TYPES, random_quantized
from gguf.quants import dequantize, quantize

from loom import LLM, SamplingParams
from loom.config import EngineConfig
from loom.model.linear import QuantizedLinear, make_matmul, pack_panels, pad_to_panels
from loom.model.quantized import QuantizedWeight, concat_rows, q8_0_from_q5_0


@pytest.fixture(scope="module")
def kernels():
    backend = make_matmul("auto", "auto")
    if backend.kernel is None or backend.quantized_kernel is None:
        pytest.skip("the packed and quantized linear kernels do not build on this machine (need AVX2 and F16C)")
    return backend


# (rows, in_features, out_features): 1-16 rows dequantize in registers (one row over three panels, even tiles),
# more go through a float32 panel; partial last panels; several blocks of rows (42 rows at 1536 features); no rows.
SHAPES = [(1, 64, 48), (1, 32, 40), (2, 96, 70), (4, 576, 960), (5, 64, 33), (7, 128, 23), (13, 64, 257),
          (16, 32, 16), (17, 64, 48), (100, 1536, 40), (64, 576, 200), (0, 32, 16)]


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), SHAPES)
def test_quantized_linear_gives_the_float32_kernels_bits(kernels, fmt, dtype, rows, in_features, out_features):
    quantized, dense = random_quantized(fmt, out_features, in_features, seed=rows * 1000 + out_features)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen) if rows % 2 else None
    got = QuantizedLinear.pack(quantized, bias, kernels.quantized_kernel)(x)
    padded = None if bias is None else pad_to_panels(bias)
    expected = kernels.kernel.packed_linear(x, pack_panels(dense), out_features, padded)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert torch.equal(got, expected)
    reference = torch.nn.functional.linear(x.double(), dense.double(), None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), reference, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-2)


@pytest.mark.parametrize(("fmt", "kernel_format"), [("q4_k", "q4_1f"), ("q5_k", "q8f"), ("q6_k", "q8f"),
                                                   ("q5_1", "q8f")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 256, 48), (1, 512, 40), (3, 512, 33), (6, 768, 16), (17, 256, 48), (70, 512, 17),
                          (0, 256, 16)])
def test_k_quants_and_q5_1_run_in_float32_scaled_records_with_the_float32_kernels_bits(
        kernels, fmt, kernel_format, dtype, rows, in_features, out_features):
    """Against gguf's own dequantizer: random super-blocks (every sub-block scale and min, every code, negative
    and zero Q6_K scales), odd row counts, partial panels."""
    quantized, dense = random_quantized(fmt, out_features, in_features, seed=rows * 100 + in_features)
    assert quantized.in_features == in_features
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    linear = QuantizedLinear.pack(quantized, None, kernels.quantized_kernel)
    assert linear.format == kernel_format
    expected = kernels.kernel.packed_linear(x, pack_panels(dense), out_features, None)
    assert torch.equal(linear(x), expected)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "q5_1", "q5_k", "q6_k"])
def test_quantized_rows_do_not_depend_on_the_batch(kernels, fmt):
    quantized, _ = random_quantized(fmt, 100, 768 if fmt.endswith("_k") else 576, seed=7)
    linear = QuantizedLinear.pack(quantized, None, kernels.quantized_kernel)
    x = torch.randn(70, quantized.in_features, generator=torch.Generator().manual_seed(3))
    whole = linear(x)  # 70 rows: through the float32 panel
    for start, size in [(0, 1), (5, 3), (20, 16), (50, 20)]:  # in registers, then the panel again
        assert torch.equal(linear(x[start:start + size]), whole[start:start + size])


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_q5_0_rewritten_as_q8_0_holds_the_same_weights(scale):
    from gguf import GGMLQuantizationType

    w = (np.random.default_rng(5).standard_normal((7, 96)) * scale).astype(np.float32)
    w[0, :32] = 0.0  # a block of zeros
    blocks = quantize(w, GGMLQuantizationType.Q5_0)
    rewritten = q8_0_from_q5_0(blocks)
    assert rewritten.shape == (7, 3 * 34)
    want = np.asarray(dequantize(blocks, GGMLQuantizationType.Q5_0), dtype=np.float32)
    got = np.asarray(dequantize(rewritten, GGMLQuantizationType.Q8_0), dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit, signed zeros included


def test_quantized_linear_rejects_a_wrong_shape_or_format(kernels):
    quantized, _ = random_quantized("q4_1", 16, 64, seed=1)
    linear = QuantizedLinear.pack(quantized, None, kernels.quantized_kernel)
    with pytest.raises(RuntimeError, match="features"):
        linear(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="records"):
        kernels.quantized_kernel.quantized_linear(torch.randn(2, 64), linear.records, "q8_0", 16, None)
    with pytest.raises(RuntimeError, match="format"):
        kernels.quantized_kernel.quantized_linear(torch.randn(2, 64), linear.records, "q4_0", 16, None)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("q4_1", torch.zeros(4, 21, dtype=torch.uint8))
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(dtype="float32", quantization="int4")


def test_a_q4_0_scale_beyond_float16_is_a_clear_error(kernels):
    blocks = np.zeros((16, 18), dtype=np.uint8)
    blocks[0, :2] = np.array([9000.0], dtype=np.float16).view(np.uint8)  # 8 d = 72000 > float16's 65504
    with pytest.raises(ValueError, match="too large"):
        QuantizedLinear.pack(QuantizedWeight("q4_0", torch.from_numpy(blocks)), None, kernels.quantized_kernel)


def test_concat_rows_stacks_one_format_only():
    a, _ = random_quantized("q4_1", 16, 64, seed=1)
    b, _ = random_quantized("q4_1", 32, 64, seed=2)
    c, _ = random_quantized("q8_0", 16, 64, seed=3)
    both = concat_rows([a, b])
    assert both is not None and both.out_features == 48 and both.in_features == 64
    assert concat_rows([a, c]) is None


def test_gguf_blocks_dequantize_to_the_loaded_weights(smollm2):
    """The blocks kept beside each weight, q and k rows reordered as the dense weights are, give the same floats."""
    assert {q.format for q in smollm2.quantized.values()} == {"q4_1", "q8_0"}
    assert len(smollm2.quantized) == 7 * smollm2.config.num_layers + 1  # every layer matmul and the tied head
    names = [n for n in smollm2.quantized if n.startswith("model.layers.0.")] + ["model.embed_tokens.weight"]
    for name in names:
        q = smollm2.quantized[name]
        dense = np.asarray(dequantize(q.blocks.numpy(), GGML_TYPES[q.format]), dtype=np.float32)
        assert torch.equal(torch.from_numpy(dense), smollm2.weights[name]), name


def test_gguf_weights_give_float32s_outputs_on_smollm2(smollm2):
    prompts = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,", "def add(a, b):", "Hello"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 9, 17, 30, 5)]
    dense = LLM(dtype="float32", loaded=smollm2, max_num_seqs=3, num_kv_blocks=64, quantization="none")
    gguf = LLM(dtype="float32", loaded=smollm2, max_num_seqs=3, num_kv_blocks=64, quantization="gguf")
    model = gguf.engine.runner.model
    assert isinstance(model.layers[0].qkv, QuantizedLinear) and model.layers[0].qkv.format == "q4_1"
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.format == "q8_0"
    expected = [o.token_ids for o in dense.generate(prompts, params)]
    assert [o.token_ids for o in gguf.generate(prompts, params)] == expected


def test_bfloat16_activations_on_gguf_weights(smollm2):
    """bfloat16 activations and KV over the exact dequantized weights: a request's tokens do not depend on its
    batch."""
    llm = LLM(loaded=smollm2, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64, quantization="gguf")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):"]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert batched == [llm.generate([p], params)[0].token_ids for p in prompts]
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))[0].text.startswith(" Paris")
