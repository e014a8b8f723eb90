"""Prefix caching changes no result and keeps the pool consistent; priorities order admission and preemption."""

from __future__ import annotations

import random

import pytest
from conftest import drive, greedy, make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom import LLM, SamplingParams
from loom.engine.kv_cache import BlockPool, block_hashes


def shared_prefix_workload(rng: random.Random, n: int, vocab: int, block_size: int) -> list[tuple[list[int], int]]:
    """Prompts built from two shared prefixes (a system prompt, few-shot examples) plus short or no suffixes."""
    prefixes = [[rng.randrange(1, vocab) for _ in range(rng.randint(block_size, 3 * block_size + 3))] for _ in "ab"]
    return [
        (rng.choice(prefixes) + [rng.randrange(1, vocab) for _ in range(rng.randint(0, 6))], rng.randint(1, 16))
        for _ in range(n)
    ]


def test_block_pool_lru_eviction_and_lookup():
    pool = BlockPool(5)  # blocks 1..4
    keys = block_hashes(list(range(12)), 4)
    assert len(keys) == 3 and keys != block_hashes(list(range(1, 13)), 4)
    a = pool.allocate(3)
    for block, key in zip(a, keys):
        pool.cache_block(block, key)
    pool.free(a[::-1])  # the tail is freed first, so it is evicted first
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 3
    assert [pool.cached_block(k) for k in keys] == a
    fresh = pool.allocate(2)  # the never-used block 4, then the least recently freed: the tail block
    assert fresh == [4, a[2]]
    assert [pool.cached_block(k) for k in keys] == [*a[:2], None] and pool.num_cached_blocks == 2
    pool.take_cached(a[:2])
    assert pool.num_free_blocks == 0 and pool.ref_count(a[0]) == 1
    pool.check_invariants()
    pool.free(a[:2] + fresh)
    assert pool.num_free_blocks == pool.num_usable_blocks
    pool.check_invariants()
    pool.reset_prefix_cache()
    assert pool.cached_block(keys[0]) is None and pool.num_cached_blocks == 0


def test_shared_prefix_is_computed_once(tiny_llama, alone_outputs):
    vocab = tiny_llama.config.vocab_size
    rng = random.Random(11)
    system = [rng.randrange(1, vocab) for _ in range(40)]  # 10 full blocks of 4
    workload = [(system + [rng.randrange(1, vocab) for _ in range(3)], 6) for _ in range(5)]
    prefill_tokens = {}
    results = {}
    for caching in (False, True):
        engine = make_engine(tiny_llama, max_num_seqs=4, budget=64, block_size=4, prefix_caching=caching)
        computed = []
        engine.step_observers.append(lambda out, *rest: computed.append(out.num_prefill_tokens))
        results[caching] = drive(engine, workload, [0, 3, 3, 4, 9])  # the first prompt is in the cache by step 3
        prefill_tokens[caching] = sum(computed)
        assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
        if caching:
            sched = engine.scheduler
            assert sched.prefix_cache_queries == 5 * 43
            assert sched.prefix_cache_hits == 4 * 40  # every later request reuses the 10 system-prompt blocks
    assert results[True] == results[False]
    for i, (prompt, n) in enumerate(workload):
        assert results[True][i] == alone_outputs(prompt, n)
    assert prefill_tokens[False] - prefill_tokens[True] == 4 * 40


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(8, 64),
    blocks=st.integers(20, 60),
    block_size=st.sampled_from([1, 2, 4, 8]),
)
def test_prefix_caching_equals_alone_with_aborts_and_preemption(tiny_llama, alone_outputs, seed, max_num_seqs, budget,
                                                                blocks, block_size):
    rng = random.Random(seed)
    workload = shared_prefix_workload(rng, rng.randint(2, 10), tiny_llama.config.vocab_size, block_size)
    blocks = max(blocks, max(-(-(len(p) + n) // block_size) for p, n in workload) + 1)
    engine = make_engine(tiny_llama, max_num_seqs, budget, blocks, block_size)
    arrivals = [rng.randint(0, 20) for _ in workload]
    aborts = {i: rng.randint(arrivals[i], arrivals[i] + 8) for i in rng.sample(range(len(workload)), len(workload) // 4)}
    done: dict[int, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(workload[i][0], greedy(workload[i][1]), request_id=str(i))
        for i, at in aborts.items():
            if at == step:
                engine.abort(str(i))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.token_ids
        engine.pool.check_invariants()
        step += 1
    for i, (prompt, n) in enumerate(workload):
        if i in done:
            assert done[i] == alone_outputs(prompt, n), f"request {i} differs with prefix caching"
        else:
            assert i in aborts
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    assert all(engine.pool.ref_count(b) == 0 for b in range(engine.pool.num_blocks))
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_priority_orders_admission(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=1)
    admitted = []
    engine.step_observers.append(lambda out, *rest: admitted.extend(r.request_id for r in out.admitted))
    for rid, prio in (("late-low", 5), ("urgent", -1), ("mid-a", 2), ("mid-b", 2)):
        engine.add_request([1, 2, 3], greedy(2), request_id=rid, priority=prio)
    engine.run_to_completion()
    assert admitted == ["urgent", "mid-a", "mid-b", "late-low"]  # lower first, FCFS within a priority
    for bad in ("high", 1.5, True):
        with pytest.raises(ValueError, match="priority"):
            engine.add_request([1, 2, 3], greedy(2), priority=bad)
    assert not engine.has_unfinished_requests()


def test_preemption_takes_the_lowest_priority_first(tiny_llama, alone_outputs):
    engine = make_engine(tiny_llama, max_num_seqs=3, budget=64, blocks=7, block_size=4, prefix_caching=False)
    preempted = []
    engine.step_observers.append(lambda out, *rest: preempted.extend(r.request_id for r in out.preempted))
    for rid, prio in (("background", 9), ("normal", 0), ("newest", 0)):
        engine.add_request([3, 4, 5, 6], greedy(12), request_id=rid, priority=prio)
    done = {k: o.token_ids for k, o in engine.run_to_completion().items()}
    assert preempted[0] == "background"  # not the newest: the lowest priority goes first
    assert all(tokens == alone_outputs([3, 4, 5, 6], 12) for tokens in done.values())
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cached_prompt_gets_the_bits_of_a_computed_one_on_smollm2(smollm2, dtype):
    """A prompt whose every full block is in the cache computes only its last token, a chunk of one: it must run
    through the prefill kernel, as it does without the cache, not the decode kernel (whose sums differ in order, and in
    bfloat16 on AMX in how P is rounded). The first token's logprob is compared to the bit."""
    prompt = list(range(1000, 1033))  # two full blocks of 16 and one token
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    fresh = LLM(loaded=smollm2, dtype=dtype, num_kv_blocks=32, enable_prefix_caching=False).generate([prompt], params)
    llm = LLM(loaded=smollm2, dtype=dtype, num_kv_blocks=32)
    llm.generate([prompt], params)
    again = llm.generate([prompt], params)
    assert llm.engine.scheduler.prefix_cache_hits == 32
    assert again[0].token_ids == fresh[0].token_ids
    assert [lp.logprob for lp in again[0].logprobs] == [lp.logprob for lp in fresh[0].logprobs]
