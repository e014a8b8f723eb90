"""AsyncEngine: the engine thread builds the model, and a step's outputs reach the event loop in one hand-off."""

from __future__ import annotations

import asyncio
import threading

import pytest

from loom import LLMEngine, SamplingParams
from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.engine.async_engine import AsyncEngine


def _config() -> EngineConfig:
    return EngineConfig(dtype="float32", scheduler=SchedulerConfig(8, 128), cache=CacheConfig(num_kv_blocks=64))


def test_a_factory_runs_on_the_engine_thread_and_its_failure_is_raised_to_the_caller(tiny_llama):
    built_on: list[str] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine(_config(), tiny_llama)

    engine = AsyncEngine(build)
    try:
        assert built_on == ["loom-engine"] and engine.is_healthy
        assert not engine.engine.has_unfinished_requests()  # the warm-up request is gone
        assert engine.engine.pool.num_free_blocks == engine.engine.pool.num_usable_blocks
    finally:
        engine.stop()

    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)


def test_each_step_hands_its_outputs_to_the_event_loop_at_once(tiny_llama):
    engine = AsyncEngine(lambda: LLMEngine(_config(), tiny_llama))
    steps: list[int] = []
    engine.engine.step_observers.append(lambda out, result, outputs, seconds: steps.append(len(outputs)))

    async def run() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        handoffs = 0
        original = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal handoffs
            handoffs += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counted
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        streams = [await engine.add([5 + i, 6, 7], params) for i in range(6)]

        async def tokens(stream) -> list[int]:
            return [t for o in [o async for o in stream.outputs()] for t in o.new_token_ids]

        return await asyncio.gather(*(tokens(s) for s in streams)), handoffs

    try:
        outputs, handoffs = asyncio.run(run())
    finally:
        engine.stop()
    assert [len(o) for o in outputs] == [12] * 6
    assert max(steps) == 6  # steps that carried every stream's token...
    assert handoffs <= len(steps) + 6  # ...each passed in one call (plus at most one wake-up per add)
