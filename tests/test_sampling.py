"""Sampling: validation, filters on hand-made logits, seeds independent of batch mix, stops and penalties."""

from __future__ import annotations

import math

import pytest
import torch

from loom import LLMEngine, SamplingParams
from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.engine.request import Request
from loom.model.sampler import _filter, sample


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("seed", "abc"),
        ("logprobs", 50),
    ],
)
def test_nonsense_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _req(**kw) -> Request:
    g = torch.Generator()
    g.manual_seed(kw.pop("seed", 0))
    return Request("r", kw.pop("prompt", [1]), SamplingParams(**kw), 0.0, generator=g)


def test_filters_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    out = _filter(logits, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.8, 1.0]),
                  min_p=torch.tensor([0.0, 0.0, 0.25]))
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [True, True, False, False, False]  # top-2
    assert kept[1].tolist() == [True, True, True, False, False]  # 0.5+0.2 < 0.8, so the third stays
    assert kept[2].tolist() == [True, True, True, False, False]  # >= 0.25 * 0.5


def test_top_k_one_is_greedy_and_penalties_change_the_choice():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    reqs = [
        _req(temperature=1.0, top_k=1, seed=5),
        _req(temperature=0.0, repetition_penalty=10.0, prompt=[1]),
        _req(temperature=0.0, frequency_penalty=2.0),
    ]
    reqs[2].output_token_ids = [1]
    tokens, _ = sample(logits, reqs)
    assert tokens == [1, 2, 2]


def test_sampling_follows_the_distribution_and_logprobs_are_reported():
    probs = torch.tensor([0.7, 0.2, 0.1])
    req = _req(temperature=1.0, seed=123, logprobs=2)
    counts = torch.zeros(3)
    for _ in range(3000):
        tokens, lps = sample(probs.log().unsqueeze(0), [req])
        counts[tokens[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)
    assert lps[0].top[0][0] == 0 and abs(lps[0].top[0][1] - math.log(0.7)) < 1e-5


def _engine(loaded, max_num_seqs=8):
    return LLMEngine(
        EngineConfig(scheduler=SchedulerConfig(max_num_seqs, 64), cache=CacheConfig(block_size=4, num_kv_blocks=256)),
        loaded,
    )


def _run(engine, jobs):
    ids = [engine.add_request(p, sp) for p, sp in jobs]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[i] for i in ids]


def test_seeded_request_is_reproducible_regardless_of_batch_mix(tiny_llama):
    seeded = ([3, 4, 5], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True))
    alone = _run(_engine(tiny_llama), [seeded])[0].token_ids
    noise = [([7, 8, 9, 10 + i], SamplingParams(max_tokens=5 + i, temperature=1.0, ignore_eos=True)) for i in range(5)]
    mixed = _run(_engine(tiny_llama), noise[:2] + [seeded] + noise[2:])[2].token_ids
    other_seed = _run(_engine(tiny_llama), [([3, 4, 5], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95,
                                                                         seed=43, ignore_eos=True))])[0].token_ids
    assert alone == mixed
    assert alone != other_seed


def test_stop_strings_stop_token_ids_and_ignore_eos(tiny_llama):
    engine = _engine(tiny_llama)
    base = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))])[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 40
    text = base.text
    stop = text[10:13]
    cut = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)] and stop not in cut.text
    tok = base.token_ids[5]
    by_id = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                      stop_token_ids=[tok]))])[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]


def test_streamed_deltas_add_up_and_hold_back_a_possible_stop(tiny_llama):
    engine = _engine(tiny_llama)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=["zzzz-never"])
    rid = engine.add_request([3, 4, 5], params)
    held = len("zzzz-never") - 1
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            pieces.append(o.new_text)
            if not o.finished:
                full = engine.requests[rid].output_text
                assert o.text == full[: max(0, len(full) - held)]
            final = o
    assert "".join(pieces) == final.text and len(final.text) > held
    assert final.request_id == rid
