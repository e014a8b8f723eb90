"""Speculative decoding by prompt lookup: draft tokens checked in one step change no greedy output (float32: the
same tokens), keep a sampled output's distribution, and keep every scheduler and cache invariant."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch
from conftest import drive, make_engine, random_workload
from hypothesis import given, settings
from hypothesis import strategies as st

from loom import LLM, SamplingParams
from loom.bench.workloads import mixed_workload
from loom.cli import build_parser
from loom.config import SpeculativeConfig
from loom.engine.ngram_proposer import NgramProposer
from loom.engine.request import Request
from loom.model.sampler import Sampler


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    propose = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2,
                                              prompt_lookup_max=3)).propose
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 9) == [4, 5, 1]  # at most num_speculative_tokens
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 2) == [4, 5]  # at most the room the request has left
    assert propose([7, 2, 3, 8, 9, 2, 3, 6, 1, 2, 3], 3) == [6, 1, 2]  # the latest of two matches
    assert propose([2, 3, 5, 1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # 3 tokens ("1 2 3") beat 2 ("2 3")
    assert propose([1, 2, 3, 4], 3) == [] and propose([5], 3) == [] and propose([1, 2, 1, 2], 0) == []
    assert propose([5, 6, 5, 5], 3) == []  # "5 5" never occurred before: no window runs off the start


def _latest_longest_match(tokens: list[int], max_drafts: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt lookup spelled out: for n from lookup_max down, the latest earlier window equal to the last n."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + max_drafts]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), max_drafts=st.integers(0, 6),
       lookup=st.tuples(st.integers(1, 5), st.integers(0, 3)))
def test_prompt_lookup_equals_the_window_by_window_search(tokens, max_drafts, lookup):
    lookup_min, extra = lookup
    config = SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_min=lookup_min,
                               prompt_lookup_max=lookup_min + extra)
    assert NgramProposer(config).propose(tokens, max_drafts) == \
        _latest_longest_match(tokens, max_drafts, lookup_min, lookup_min + extra)


def _request(temperature: float = 0.0, logprobs: int | None = None, seed: int = 0) -> Request:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return Request("r", [1], SamplingParams(temperature=temperature, logprobs=logprobs), 0.0, generator=generator)


def test_greedy_check_accepts_drafts_while_they_are_the_argmax():
    logits = torch.full((7, 10), -5.0)
    for row, best in enumerate([3, 4, 5, 6, 7, 8, 9]):
        logits[row, best] = 5.0
    # Rows 0-3 belong to a request with drafts [3, 4, 0] (the third wrong), rows 4-6 to one whose 2 drafts hold.
    emitted, logprobs = Sampler().verify(logits, [_request(), _request(logprobs=1)], [[3, 4, 0], [7, 8]])
    assert emitted == [[3, 4, 5], [7, 8, 9]]
    assert logprobs[0] == [None] * 3
    assert [lp.token_id for lp in logprobs[1]] == [7, 8, 9] and all(lp.top[0][0] == lp.token_id for lp in logprobs[1])
    assert Sampler().verify(logits[:2], [_request()], [[9]])[0] == [[3]]  # the first draft wrong: one token


def test_sampled_check_keeps_the_distribution():
    """Draws of the tokens after a one-token draft, over many seeds, follow the model's probabilities, whether the
    draft is likely, unlikely or impossible."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.3, 0.0]])
    logits = probs.clamp_min(1e-30).log()
    for draft in (0, 2, 3):
        first, second = Counter(), Counter()
        for seed in range(3000):
            (tokens,), _ = Sampler().verify(logits, [_request(temperature=1.0, seed=seed)], [[draft]])
            first[tokens[0]] += 1
            if len(tokens) == 2:
                second[tokens[1]] += 1
        assert all(abs(first[t] / 3000 - float(probs[0, t])) < 0.03 for t in range(4)), (draft, first)
        if draft != 3:
            n = sum(second.values())
            assert n == first[draft] and all(abs(second[t] / n - float(probs[1, t])) < 0.05 for t in range(4))


class OracleProposer:
    """Proposes each request's true greedy continuation, every third proposal with its last draft wrong: drafts
    that a random tiny model's own context would almost never supply, accepted and rejected."""

    def __init__(self, continuations: dict[tuple, list[int]], k: int) -> None:
        self.continuations, self.k, self.calls = continuations, k, 0

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        self.calls += 1
        for prompt, output in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = output[done : done + min(self.k, max_drafts)]
                if drafts and self.calls % 3 == 0:
                    drafts[-1] = (drafts[-1] + 1) % 320
                return drafts
        raise AssertionError("unknown request")


@pytest.mark.parametrize("k, budget", [(1, 20), (4, 20), (20, 48)])
def test_drafts_in_batch_mixes_change_no_greedy_output(tiny_llama, alone_outputs, k, budget):
    """Chunked prompts, a token budget that trims drafts, few blocks (preemption): every request as alone. With 20
    drafts a check is a chunk of up to 21 tokens over several of the cache's 4-token blocks."""
    rng = random.Random(k)
    workload = random_workload(rng, 24, 320)
    expected = {i: alone_outputs(p, n) for i, (p, n) in enumerate(workload)}
    engine = make_engine(tiny_llama, max_num_seqs=6, budget=budget, blocks=24)
    engine.config.speculative = SpeculativeConfig(num_speculative_tokens=k)
    engine.proposer = OracleProposer({tuple(p): expected[i] for i, (p, _) in enumerate(workload)}, k)
    preempted, checked = [], [0]
    engine.step_observers.append(lambda out, *_: preempted.extend(out.preempted))
    engine.step_observers.append(lambda out, *_: checked.extend(len(s.draft_token_ids) for s in out.scheduled))
    got = drive(engine, workload, [rng.randint(0, 8) for _ in workload])
    assert got == expected
    assert preempted and engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens
    assert max(checked) == k
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


@pytest.fixture(scope="module")
def smol_requests(smollm2):
    """The mixed workload's first requests (its prompts repeat text, so prompt lookup finds drafts), shortened."""
    return [(w.prompt, min(w.max_tokens, 40)) for w in mixed_workload(smollm2.tokenizer, 6)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["constant", "heuristic", "heuristic_transient"])
def test_smollm2_float32_gives_the_same_tokens_stops_and_logprobs_with_prompt_lookup(smollm2, smol_requests,
                                                                                     schedule):
    prompts = [p for p, _ in smol_requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1) for _, n in smol_requests]
    plain = LLM(dtype="float32", loaded=smollm2, max_num_seqs=4).generate(prompts, params)
    spec = LLM(dtype="float32", loaded=smollm2, max_num_seqs=4, speculative_config={"num_speculative_tokens": 4,
                                                                   "num_speculative_tokens_schedule": schedule})
    drafted = spec.generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    for a, b in zip(drafted, plain):
        assert [lp.top[0][0] for lp in a.logprobs] == [lp.top[0][0] for lp in b.logprobs]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    engine = spec.engine
    assert engine.num_accepted_tokens > 0.8 * engine.num_draft_tokens > 0
    # A stop string inside a run of accepted drafts ends the output where it ends one token at a time.
    stops = [o.text[len(o.text) // 2 : len(o.text) // 2 + 6] for o in plain]
    params = [SamplingParams(max_tokens=n, temperature=0.0, stop=[s]) for (_, n), s in zip(smol_requests, stops)]
    expected = LLM(dtype="float32", loaded=smollm2, max_num_seqs=4).generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == \
        [(o.text, o.token_ids, o.finish_reason) for o in expected]
    assert all(o.finish_reason == "stop" for o in got)


def test_the_cli_takes_vllms_speculative_config_json():
    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'])
    assert args.speculative_config == SpeculativeConfig("ngram", 5, 2, 3)
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"num_speculative_tokens": 2.5}', "{not json",
                '{"draft_model": "x"}'):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--speculative-config", bad])


def test_drafts_follow_the_number_of_running_requests(tiny_llama, alone_outputs):
    """vLLM's num_speculative_tokens_per_batch_size: no drafts while 4-6 requests run, at most 1 while 2-3 do, the
    full 4 alone; the outputs stay each request's alone output."""
    rng = random.Random(5)
    workload = random_workload(rng, 12, 320)
    expected = {i: alone_outputs(p, n) for i, (p, n) in enumerate(workload)}
    engine = make_engine(tiny_llama, max_num_seqs=6, budget=40, blocks=96)
    engine.config.speculative = SpeculativeConfig(num_speculative_tokens=4,
                                                  num_speculative_tokens_per_batch_size=[[4, 6, 0], [2, 3, 1]])
    engine.proposer = OracleProposer({tuple(p): expected[i] for i, (p, _) in enumerate(workload)}, 4)
    drafts_by_running: dict[int, int] = {}
    running_before = [0]

    def observe(out, *_):
        # The drafts this step checks were proposed after the previous step, with running_before[0] requests.
        most = max((len(s.draft_token_ids) for s in out.scheduled), default=0)
        drafts_by_running[running_before[0]] = max(drafts_by_running.get(running_before[0], 0), most)
        running_before[0] = len(engine.scheduler.running)

    engine.step_observers.append(observe)
    got = drive(engine, workload, [rng.randint(0, 10) for _ in workload])
    assert got == expected
    assert all(most == 0 for running, most in drafts_by_running.items() if running >= 4)
    assert all(most <= 1 for running, most in drafts_by_running.items() if running in (2, 3))
    assert drafts_by_running.get(1) == 4 and max(drafts_by_running[r] for r in (2, 3) if r in drafts_by_running) == 1


@pytest.mark.parametrize("ranges,message", [
    ([[1, 8, 2], [8, 16, 1]], "overlap"),
    ([[1, 8, 5]], "0 <= k"),
    ([[0, 8, 1]], "1 <= start"),
    ([[9, 8, 1]], "start <= end"),
    ([[1, 8]], "entries"),
    ([[1, 8, 1.5]], "entries"),
])
def test_bad_per_batch_size_drafts_are_refused(ranges, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=ranges)


def test_per_batch_size_drafts_from_the_command_line():
    args = build_parser().parse_args(["serve", "--speculative-config", '{"num_speculative_tokens": 5, '
                                      '"num_speculative_tokens_per_batch_size": [[17, 64, 0], [1, 16, 3]]}'])
    config = args.speculative_config
    assert [config.drafts_for(n) for n in (1, 16, 17, 64, 65)] == [3, 3, 0, 0, 5]


@pytest.mark.parametrize("schedule", ["heuristic", "heuristic_transient"])
def test_the_heuristic_schedules_move_each_requests_limit_by_its_checks(schedule):
    spec = SpeculativeConfig(num_speculative_tokens=5, num_speculative_tokens_schedule=schedule)
    limit, limits = spec.first_draft_limit(None), []
    for drafted, accepted in [(2, 2), (4, 4), (5, 5), (5, 3), (4, 0), (3, 1), (2, 0), (1, 0), (1, 1)]:
        limit = spec.next_draft_limit(limit, drafted, accepted)
        limits.append(limit)
    assert spec.first_draft_limit(None) == 2 and limits == [4, 5, 5, 4, 3, 2, 1, 1, 3]
    # A new request starts where the latest check left off (heuristic) or at 2 again (heuristic_transient).
    assert spec.first_draft_limit(4) == (4 if schedule == "heuristic" else 2)
    assert SpeculativeConfig(num_speculative_tokens=1, num_speculative_tokens_schedule=schedule) \
        .first_draft_limit(None) == 1
    args = build_parser().parse_args(["serve", "--speculative-config", '{"num_speculative_tokens": 12, '
                                      f'"num_speculative_tokens_schedule": "{schedule}"}}'])
    assert args.speculative_config.first_draft_limit(None) == 2
    assert args.speculative_config.next_draft_limit(12, 3, 3) == 12


def test_the_constant_schedule_keeps_every_limit_and_others_are_refused():
    constant = SpeculativeConfig(num_speculative_tokens=5)
    assert constant.first_draft_limit(None) == constant.first_draft_limit(2) == 5
    assert constant.next_draft_limit(5, 5, 0) == 5
    with pytest.raises(ValueError, match="must be one of"):
        SpeculativeConfig(num_speculative_tokens_schedule="adaptive")


def test_transient_heuristic_drafts_follow_each_requests_checks(tiny_llama, alone_outputs):
    """Under heuristic_transient a request's first check takes at most 2 drafts and each later one at most what
    its earlier checks allow (replayed here), while the outputs stay each request's alone output."""
    rng = random.Random(7)
    workload = random_workload(rng, 12, 320)
    expected = {i: alone_outputs(p, n) for i, (p, n) in enumerate(workload)}
    engine = make_engine(tiny_llama, max_num_seqs=4, budget=64, blocks=96)
    spec = SpeculativeConfig(num_speculative_tokens=6, num_speculative_tokens_schedule="heuristic_transient")
    engine.config.speculative = spec
    engine.proposer = OracleProposer({tuple(p): expected[i] for i, (p, _) in enumerate(workload)}, 6)
    checks: dict[str, list[tuple[int, int]]] = {}  # request id -> (drafted, accepted) of each check

    def observe(out, result, *_):
        for sched, tokens in zip(out.scheduled, result.tokens):
            if sched.draft_token_ids:
                checks.setdefault(sched.request.request_id, []).append((len(sched.draft_token_ids), len(tokens) - 1))

    engine.step_observers.append(observe)
    got = drive(engine, workload, [rng.randint(0, 6) for _ in workload])
    assert got == expected
    for history in checks.values():
        limit = spec.first_draft_limit(None)
        for drafted, accepted in history:
            assert drafted <= limit
            limit = spec.next_draft_limit(limit, drafted, accepted)
    drafted = [d for history in checks.values() for d, _ in history]
    assert max(drafted) == 6 and any(a < d for history in checks.values() for d, a in history)


def test_heuristic_limits_persist_from_request_to_request(tiny_llama, alone_outputs):
    """Under heuristic, requests run one after another each start where the previous one's last check left its
    limit (replayed here), as transformers' value persists from call to call; the outputs stay the alone outputs."""
    rng = random.Random(11)
    workload = [(p, n + 12) for p, n in random_workload(rng, 6, 320)]
    expected = {i: alone_outputs(p, n) for i, (p, n) in enumerate(workload)}
    engine = make_engine(tiny_llama, max_num_seqs=1, budget=64, blocks=96)
    spec = SpeculativeConfig(num_speculative_tokens=6, num_speculative_tokens_schedule="heuristic")
    engine.config.speculative = spec
    engine.proposer = OracleProposer({tuple(p): expected[i] for i, (p, _) in enumerate(workload)}, 6)
    checks: list[tuple[str, int, int]] = []  # (request id, drafted, accepted), in the order checked

    def observe(out, result, *_):
        for sched, tokens in zip(out.scheduled, result.tokens):
            if sched.draft_token_ids:
                checks.append((sched.request.request_id, len(sched.draft_token_ids), len(tokens) - 1))

    engine.step_observers.append(observe)
    assert drive(engine, workload, [0] * len(workload)) == expected
    limits: dict[str, int] = {}
    latest, first_drafts = None, []
    for rid, drafted, accepted in checks:
        if rid not in limits:
            limits[rid] = spec.first_draft_limit(latest)
            first_drafts.append(drafted)
        assert drafted <= limits[rid]
        latest = limits[rid] = spec.next_draft_limit(limits[rid], drafted, accepted)
    assert len(first_drafts) > 1 and max(first_drafts[1:]) > 2  # later requests' first checks passed transient's 2


class RandomProposer:
    """Drafts of 0-3 random tokens, seeded: nearly all rejected, so every check ends in a rejection path."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        return [self.rng.randrange(320) for _ in range(min(self.rng.randint(0, 3), max_drafts))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drafts_beside_grammars_logprobs_stops_aborts_and_preemption(tiny_llama, alone_outputs, seed):
    """Every kind of request in one engine with drafts, some aborted as they run, in a cache small enough to
    preempt: the pool's invariants hold every step, plain greedy requests give their alone outputs, grammars are
    followed, and every block comes back."""
    from loom import StructuredOutputParams

    rng = random.Random(seed)
    engine = make_engine(tiny_llama, max_num_seqs=6, budget=24, blocks=36)
    engine.config.speculative = SpeculativeConfig(num_speculative_tokens=3)
    engine.proposer = RandomProposer(seed)
    engine.step_observers.append(lambda *_: engine.pool.check_invariants())
    kinds = {
        "greedy": lambda: SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True),
        "sampled": lambda: SamplingParams(max_tokens=16, temperature=1.0, seed=rng.randrange(100), logprobs=2,
                                          ignore_eos=True),
        "grammar": lambda: SamplingParams(max_tokens=24, temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(100),
                                          structured_outputs=StructuredOutputParams(regex="[a-z]{2,5}")),
        "stops": lambda: SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[rng.randrange(320)],
                                        allowed_token_ids=list(range(0, 320, 3))),
    }
    requests = {}
    for i in range(30):
        kind = rng.choice(sorted(kinds))
        prompt = [rng.randrange(1, 320) for _ in range(rng.randint(1, 30))]
        requests[engine.add_request(prompt, kinds[kind](), request_id=str(i))] = (kind, prompt)
    finished, aborted, step = {}, set(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
        running = [r.request_id for r in engine.scheduler.running]
        if step % 5 == 0 and running:
            victim = rng.choice(running)
            finished[victim] = engine.abort(victim)
            aborted.add(victim)
    assert set(finished) == set(requests) and aborted and engine.scheduler.num_preemptions
    assert engine.num_draft_tokens > 50
    for rid, (kind, prompt) in requests.items():
        out = finished[rid]
        if rid in aborted:
            assert out.finish_reason == "abort"
        elif kind == "greedy":
            assert out.token_ids == alone_outputs(prompt, len(out.token_ids))
        elif kind == "grammar":
            assert re.fullmatch("[a-z]{2,5}", out.text), out.text
        elif kind == "sampled":
            assert [lp.token_id for lp in out.logprobs] == out.token_ids and len(out.token_ids) == 16
        else:
            assert set(out.token_ids) <= set(range(0, 320, 3))
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
