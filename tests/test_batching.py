"""Packing changes no result: continuous == static == one-at-a-time, under many batch mixes, with preemption.

Also checks the scheduler's per-step promises and that the block pool is full again after every workload.
"""

from __future__ import annotations

import random

import pytest
from conftest import drive, greedy, make_engine, random_workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom.engine.request import RequestStatus


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(8, 80),
    blocks=st.integers(24, 80),
    block_size=st.sampled_from([1, 2, 4, 16]),
    pacing=st.sampled_from([0, 1, 4, 32]),
)
def test_continuous_equals_alone_under_random_mixes(tiny_llama, alone_outputs, seed, max_num_seqs, budget, blocks,
                                                    block_size, pacing):
    rng = random.Random(seed)
    workload = random_workload(rng, rng.randint(1, 10), tiny_llama.config.vocab_size)
    blocks = max(blocks, max(-(-(len(p) + n) // block_size) for p, n in workload) + 1)
    engine = make_engine(tiny_llama, max_num_seqs, budget, blocks, block_size, long_prefill_chunk_tokens=pacing)
    arrivals = [rng.randint(0, 30) for _ in workload]
    done = drive(engine, workload, arrivals)
    for i, (prompt, n) in enumerate(workload):
        assert done[i] == alone_outputs(prompt, n), f"request {i} differs in the mix"
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_tiny_pool_forces_preemption_without_changing_results(tiny_llama, alone_outputs):
    rng = random.Random(7)
    workload = [(p, 24) for p, _ in random_workload(rng, 8, tiny_llama.config.vocab_size)]
    engine = make_engine(tiny_llama, max_num_seqs=8, budget=64, blocks=18, block_size=4)
    done = drive(engine, workload, [0] * len(workload))
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for all 8 at once"
    for i, (prompt, n) in enumerate(workload):
        assert done[i] == alone_outputs(prompt, n)
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


@pytest.mark.parametrize("backend", ["paged", "sdpa", "reference"])
def test_static_equals_continuous_and_counts_padding(tiny_llama, alone_outputs, backend):
    rng = random.Random(3)
    workload = random_workload(rng, 7, tiny_llama.config.vocab_size)
    results = {}
    for policy in ("static", "continuous"):
        engine = make_engine(tiny_llama, max_num_seqs=3, budget=256, policy=policy, backend=backend)
        results[policy] = drive(engine, workload, [0] * len(workload))
        assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
        if policy == "static":
            waves = [workload[i : i + 3] for i in range(0, len(workload), 3)]
            expected_pad = sum(
                sum(max(len(p) for p, _ in w) - len(p) for p, _ in w)  # prompts padded to the longest
                + sum(max(n for _, n in w) - n for _, n in w)  # finished slots idle until the longest ends
                for w in waves
            )
            assert engine.scheduler.num_pad_tokens == expected_pad
    assert results["static"] == results["continuous"]
    for i, (prompt, n) in enumerate(workload):
        assert results["continuous"][i] == alone_outputs(prompt, n)


def test_static_admits_nobody_before_the_wave_ends(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2, policy="static")
    admitted_at: dict[str, int] = {}
    finished_at: dict[str, int] = {}

    def observe(out, result, outputs, seconds):
        for r in out.admitted:
            admitted_at[r.request_id] = out.step
        for o in outputs:
            if o.finished:
                finished_at[o.request_id] = out.step

    engine.step_observers.append(observe)
    for i, n in enumerate((2, 10, 3, 3)):
        engine.add_request([5, 6, 7], greedy(n), request_id=str(i))
    while engine.has_unfinished_requests():
        engine.step()
    # Request "2" waits for the whole first wave (its longest request, "1"), not for the short "0".
    assert admitted_at["2"] == admitted_at["3"] == finished_at["1"] + 1
    assert finished_at["0"] < finished_at["1"]


def test_continuous_admits_on_the_step_a_slot_frees(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2, budget=64)
    events: list[tuple[int, str, str]] = []

    def observe(out, result, outputs, seconds):
        events.extend((out.step, "admit", r.request_id) for r in out.admitted)
        events.extend((out.step, "finish", o.request_id) for o in outputs if o.finished)

    engine.step_observers.append(observe)
    for i, n in enumerate((2, 10, 3)):
        engine.add_request([5, 6, 7], greedy(n), request_id=str(i))
    while engine.has_unfinished_requests():
        engine.step()
    finish_0 = next(s for s, kind, rid in events if kind == "finish" and rid == "0")
    admit_2 = next(s for s, kind, rid in events if kind == "admit" and rid == "2")
    assert admit_2 == finish_0 + 1  # the very next schedule fills the freed slot


def test_long_prompt_is_chunked_and_decodes_keep_running(tiny_llama, alone_outputs):
    engine = make_engine(tiny_llama, max_num_seqs=4, budget=16)
    chunks: list[int] = []

    def observe(out, result, outputs, seconds):
        for s in out.scheduled:
            if s.request.request_id == "1":
                chunks.append(len(s.token_ids))

    engine.step_observers.append(observe)
    short, long_prompt = [9, 8, 7], list(range(1, 101))
    workload = [(short, 20), (long_prompt, 4)]
    done = drive(engine, workload, [0, 2], check_steps=False)
    engine.step_observers.clear()
    assert chunks[0] < 16 and max(chunks) <= 16 and sum(chunks[:-3]) >= 100 - 16
    assert len([c for c in chunks if c > 1]) >= 100 // 16  # the prompt went in over several steps
    assert done[0] == alone_outputs(short, 20) and done[1] == alone_outputs(long_prompt, 4)


@pytest.mark.parametrize("pacing", [0, 4])
def test_long_prompt_is_paced_while_others_decode(tiny_llama, alone_outputs, pacing):
    """Beside 3 decoding requests a 100-token prompt (longer than the 32-token budget) takes, with pacing on, the
    longest chunk whose positions p cost at most max(4, 3) in sum(1 + p / K); with it off, what the decodes leave.
    Alone, it takes the whole budget."""
    engine = make_engine(tiny_llama, max_num_seqs=4, budget=32, long_prefill_chunk_tokens=pacing)
    keys_per_token = tiny_llama.config.attention_keys_per_token
    chunks: list[tuple[int, int, int]] = []  # (decodes beside it, start position, chunk length)

    def observe(out, result, outputs, seconds):
        decodes = sum(s.is_decode for s in out.scheduled)
        chunks.extend((decodes, s.start_position, len(s.token_ids))
                      for s in out.scheduled if s.request.num_prompt_tokens == 100)

    def cost(start: int, n: int) -> float:
        return sum(1 + p / keys_per_token for p in range(start, start + n))

    engine.step_observers.append(observe)
    shorts = [([9, 8, 7], 40), ([5, 4], 40), ([3, 2, 1, 4], 40)]
    long_prompt = list(range(1, 101))
    done = drive(engine, shorts + [(long_prompt, 3)], [0, 0, 0, 2])
    prefill = [c for c in chunks if c[1] < 100]  # the prompt's positions, not its decodes
    assert sum(n for _, _, n in prefill) == 100 and all(d == 3 for d, _, _ in prefill)
    for _, start, n in prefill[:-1]:
        if pacing:
            assert cost(start, n) <= 4 < cost(start, n + 1)
        else:
            assert n == 32 - 3
    assert len(prefill) > 100 // 4 if pacing else len(prefill) == 4
    for i, (prompt, n) in enumerate(shorts + [(long_prompt, 3)]):
        assert done[i] == alone_outputs(prompt, n)

    chunks.clear()
    drive(engine, [(long_prompt[::-1], 2)], [0])
    assert [n for _, _, n in chunks][:4] == [32, 32, 32, 4]  # nobody decoding: nobody to protect


def test_abort_frees_blocks_and_slot(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    a = engine.add_request([1, 2, 3, 4, 5], greedy(20))
    b = engine.add_request([6, 7, 8], greedy(5))
    c = engine.add_request([9], greedy(3))  # waiting: no slot yet
    engine.step()
    engine.step()
    out = engine.abort(a)
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort(c).finish_reason == "abort"  # aborting a waiting request works too
    assert engine.abort("no-such-request") is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    assert b not in engine.requests


def test_preempted_request_goes_back_to_waiting_first(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=3, budget=64, blocks=7, block_size=4)
    for i in range(3):
        engine.add_request([3, 4, 5, 6], greedy(12), request_id=str(i))
    preempted = []
    engine.step_observers.append(lambda out, *rest: preempted.extend(out.preempted))
    while engine.has_unfinished_requests():
        engine.step()
        for r in preempted:
            assert r.status in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED)
    assert preempted and preempted[0].request_id == "2"  # the newest running request is the victim
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
