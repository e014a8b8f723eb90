"""The C++ loop over a Llama model's layers (loom/model/layer_loop.py): the bits of the Python loop, at every step of
a mixed workload, and only where its kernels are the model's."""

from __future__ import annotations

import pytest
import torch

from conftest import greedy, torch_threads
from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.engine.engine import LLMEngine
from loom.engine.llm import LLM
from loom.model.linear import make_matmul
from loom.model.llama import LlamaModel


@pytest.fixture(scope="module")
def amx():
    if make_matmul("auto", "none", torch.bfloat16).amx_kernel is None:
        pytest.skip("no AMX-BF16 on this CPU (or Linux did not grant the tile state)")


class CountingLoop:
    """Stands in for the kernel's LayerLoop and counts its runs."""

    def __init__(self, inner) -> None:
        self.inner, self.runs = inner, 0

    def bind_caches(self, *caches) -> None:
        self.inner.bind_caches(*caches)

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


@pytest.mark.parametrize("quantization, kv_cache_dtype", [("auto", "auto"), ("auto", "int8"), ("none", "auto")])
def test_layer_loop_gives_the_python_loops_bits(smollm2, amx, quantization, kv_cache_dtype):
    """SmolLM2 in bfloat16 on AMX, from its GGUF blocks or dense: prompt chunks beside decodes, decodes alone and
    prefix-cache hits, with a bfloat16 and an int8 KV cache."""
    config = EngineConfig(dtype="bfloat16", quantization=quantization,
                          scheduler=SchedulerConfig(4, 48, "continuous", 32),
                          cache=CacheConfig(block_size=16, num_kv_blocks=96, kv_cache_dtype=kv_cache_dtype))
    engine = LLMEngine(config, smollm2)
    model = engine.runner.model
    assert model.layer_loop is not None
    counting, steps = check_each_forward(model)
    shared = list(range(1000, 1040))  # two whole blocks that later prompts find in the prefix cache
    prompts = [shared + [7, 8, 9], list(range(200, 290)), shared + [11, 12], [5, 6, 7, 8]]
    ids = [engine.add_request(p, greedy(12)) for p in prompts]
    finished = engine.run_to_completion()
    assert all(len(finished[i].token_ids) == 12 for i in ids)
    assert counting.runs == len(steps) and max(steps) > len(prompts) and min(steps) <= len(prompts)


def test_layer_loop_leaves_larger_steps_to_python(smollm2, amx):
    """A step of more rows than one MLP chunk (1024 a thread) runs the Python loop, which splits the MLP."""
    with torch_threads(1):
        llm = LLM(loaded=smollm2, dtype="bfloat16", max_num_batched_tokens=1100, num_kv_blocks=96)
        model = llm.engine.runner.model
        counting, steps = check_each_forward(model)
        llm.generate([list(range(100, 1200))], greedy(2))
    assert steps == [1100, 1] and counting.runs == 1


@pytest.mark.parametrize("options", [{"matmul_backend": "packed", "quantization": "none"}, {"layer_ops": "torch"},
                                     {"dtype": "float32"}])
def test_layer_loop_only_where_its_kernels_run(smollm2, amx, options):
    """Matmuls off AMX, torch's layer ops or float32: the Python loop."""
    llm = LLM(loaded=smollm2, **{"dtype": "bfloat16", "num_kv_blocks": 16, **options})
    assert llm.engine.runner.model.layer_loop is None
