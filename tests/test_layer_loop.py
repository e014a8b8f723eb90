"""The C++ loop over a Llama model's layers (loom/model/layer_loop.py): the bits of the Python loop, at every step of
a mixed workload, on each of Loom's matmul kernels, and only where its kernels are the model's."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, torch_threads

from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.engine.engine import LLMEngine
from loom.engine.llm import LLM
from loom.model.kernels import load_layer_loop, load_layer_ops
from loom.model.linear import PackedLinear, QuantizedLinear, SiluMulAfter, make_matmul
from loom.model.llama import LlamaModel


@pytest.fixture(scope="module")
def amx():
    if make_matmul("auto", "none", torch.bfloat16).amx_kernel is None:
        pytest.skip("no AMX-BF16 on this CPU (or Linux did not grant the tile state)")


class CountingLoop:
    """Stands in for the kernel's LayerLoop and counts its runs."""

    def __init__(self, inner) -> None:
        self.inner, self.runs = inner, 0

    def bind(self, *caches_and_attention) -> None:
        self.inner.bind(*caches_and_attention)

    def run(self, *args) -> torch.Tensor:
        self.runs += 1
        return self.inner.run(*args)


def check_each_forward(model: LlamaModel) -> tuple[CountingLoop, list[int]]:
    """From now on each forward of `model` runs twice, the Python loop then the C++ one (a step's K/V writes are the
    same both times), and asserts the same hidden states; returns the loop's counter and each step's token count."""
    loop = model.layer_loop
    counting = loop.loop = CountingLoop(loop.loop)
    steps: list[int] = []

    def both(meta, kv_caches, attention):
        model.layer_loop = None
        expected = LlamaModel.forward(model, meta, kv_caches, attention)
        model.layer_loop = loop
        got = LlamaModel.forward(model, meta, kv_caches, attention)
        assert torch.equal(got, expected), f"the loop's bits differ at a step of {meta.num_tokens} tokens"
        steps.append(meta.num_tokens)
        return got

    model.forward = both
    return counting, steps


def run_both_ways(loaded, kv_cache_dtype: str = "auto", **options) -> tuple[LlamaModel, CountingLoop, list[int]]:
    """An engine of `options` (EngineConfig's) runs prompt chunks beside decodes, decodes alone and prefix-cache hits,
    each forward both ways (check_each_forward); returns its model, the loop's counter and each step's token count."""
    config = EngineConfig(**options, scheduler=SchedulerConfig(4, 48, "continuous", 32),
                          cache=CacheConfig(block_size=16, num_kv_blocks=96, kv_cache_dtype=kv_cache_dtype))
    engine = LLMEngine(config, loaded)
    model = engine.runner.model
    assert model.layer_loop is not None
    counting, steps = check_each_forward(model)
    shared = list(range(1000, 1040))  # two whole blocks that later prompts find in the prefix cache
    prompts = [shared + [7, 8, 9], list(range(200, 290)), shared + [11, 12], [5, 6, 7, 8]]
    ids = [engine.add_request(p, greedy(12)) for p in prompts]
    finished = engine.run_to_completion()
    assert all(len(finished[i].token_ids) == 12 for i in ids)
    return model, counting, steps


@pytest.mark.parametrize("quantization, kv_cache_dtype", [("auto", "auto"), ("auto", "int8"), ("none", "auto")])
def test_layer_loop_gives_the_python_loops_bits(smollm2, amx, quantization, kv_cache_dtype):
    """SmolLM2 in bfloat16 on AMX, from its GGUF blocks or dense, with a bfloat16 and an int8 KV cache."""
    _, counting, steps = run_both_ways(smollm2, kv_cache_dtype, dtype="bfloat16", quantization=quantization)
    assert counting.runs == len(steps) and max(steps) > 4 and min(steps) <= 4


@pytest.mark.parametrize("dtype, quantization, matmul", [
    ("bfloat16", "auto", QuantizedLinear), ("bfloat16", "none", PackedLinear), ("float32", "auto", QuantizedLinear),
    ("float32", "none", PackedLinear)])
def test_layer_loop_on_the_other_matmuls(smollm2, dtype, quantization, matmul):
    """The packed and the quantized kernels (CPUs without AMX, and float32), SwiGLU's silu_mul after the product:
    the Python loop's bits, and the loop ran at every step."""
    model, counting, steps = run_both_ways(smollm2, dtype=dtype, quantization=quantization, matmul_backend="packed")
    assert type(model.layers[0].qkv) is matmul and isinstance(model.layers[0].gate_up, SiluMulAfter)
    assert counting.runs == len(steps) > 0


def test_layer_loop_leaves_larger_steps_to_python(smollm2, amx):
    """A step of more rows than one MLP chunk (1024 a thread) runs the Python loop, which splits the MLP."""
    with torch_threads(1):
        llm = LLM(loaded=smollm2, dtype="bfloat16", max_num_batched_tokens=1100, num_kv_blocks=96)
        model = llm.engine.runner.model
        counting, steps = check_each_forward(model)
        llm.generate([list(range(100, 1200))], greedy(2))
    assert steps == [1100, 1] and counting.runs == 1


@pytest.mark.parametrize("options", [{"matmul_backend": "torch", "quantization": "none"}, {"layer_ops": "torch"}])
def test_layer_loop_only_where_its_kernels_run(smollm2, options):
    """torch's matmuls or torch's layer ops: the Python loop."""
    llm = LLM(loaded=smollm2, **{"dtype": "bfloat16", "num_kv_blocks": 16, **options})
    assert llm.engine.runner.model.layer_loop is None


def test_layer_loop_takes_entry_points_by_signature():
    """A kernel entry point of another signature, or any other object, is refused with a TypeError, not called."""
    loop_kernel, ops_kernel = load_layer_loop(), load_layer_ops()
    if loop_kernel is None or ops_kernel is None:
        pytest.skip("the layer loop's or the layer ops' kernel does not build here")
    entries = (ops_kernel.add_rms_norm_entry, ops_kernel.rotary_entry, ops_kernel.silu_mul_entry)
    loop_kernel.LayerLoop(9, 3, 64, 1e-5, *entries)
    for wrong in [(ops_kernel.rotary_entry, *entries[1:]), (entries[0], entries[1], ops_kernel.add_rms_norm_entry),
                  (entries[0], "rotary_", entries[2])]:
        with pytest.raises(TypeError, match="entry point"):
            loop_kernel.LayerLoop(9, 3, 64, 1e-5, *wrong)
