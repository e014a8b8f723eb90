"""Sampling: validation, filters on hand-made logits, seeds independent of batch mix, stops and penalties."""

from __future__ import annotations

import math

import pytest
import torch

from loom import LLM, LLMEngine, SamplingParams
from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.engine.input import bad_words_token_ids
from loom.engine.request import Request
from loom.model.kernels import load_argmax
from loom.model.sampler import Sampler, _filter, make_sampler


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
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {5: math.inf}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", [(5, 1.0)]),
        ("skip_special_tokens", 1),
        ("include_stop_str_in_output", "yes"),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above the default max_tokens of 16
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


@pytest.fixture(scope="module")
def argmax_kernel():
    kernel = load_argmax()
    assert kernel is not None, "the argmax kernel must build on the CI machine"
    return kernel


def _rows_with_ties_and_nans() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rows = 3 * torch.randn(9, 49152, generator=gen)
    rows[1, [7, 30000, 49151]] = 50.0  # ties: the first index wins
    rows[2, 49151] = 60.0  # the maximum in the last lane of the last vector
    rows[3, [100, 40000]] = math.nan  # torch orders NaN above every number: the first NaN wins
    rows[4, -3:] = math.nan  # a NaN only in the row's tail
    rows[5] = -math.inf
    rows[6, :40000] = -math.inf
    rows[7] = 0.0
    rows[8, ::2] = -0.0  # equal to 0.0: the first of them wins
    return rows


def test_argmax_kernel_matches_torch(argmax_kernel):
    rows = _rows_with_ties_and_nans()
    assert torch.equal(argmax_kernel.argmax_rows(rows), rows.argmax(dim=-1))
    for width in (1, 7, 8, 13, 17):  # shorter than a vector, whole vectors, a tail
        narrow = rows[:, -width:].contiguous()
        assert torch.equal(argmax_kernel.argmax_rows(narrow), narrow.argmax(dim=-1)), width
    strided = rows[:, :1000]  # not contiguous: copied first
    assert torch.equal(argmax_kernel.argmax_rows(strided), strided.argmax(dim=-1))
    assert argmax_kernel.argmax_rows(rows[:0]).shape == (0,)
    halves = rows.to(torch.bfloat16)  # a bfloat16 model's logits: the argmax of their exact float32 copy
    assert torch.equal(argmax_kernel.argmax_rows(halves), halves.float().argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        argmax_kernel.argmax_rows(rows.half())
    assert make_sampler().argmax_kernel is not None


def test_argmax_kernel_on_bfloat16_matches_torch_on_their_float32_copy(argmax_kernel):
    """bfloat16 rows go by their bits, 32 at a time: tails of every length around a vector, NaNs of either sign,
    -0 before +0, denormals, and rows of random bit patterns (NaNs and infinities among them)."""
    rows = _rows_with_ties_and_nans().to(torch.bfloat16)
    rows[0, [5, 900]] = -math.nan  # a NaN with its sign bit set still outranks every number
    rows[7, ::3] = -0.0  # a row of zeros, -0 first: equal to +0, so index 0 wins
    rows[5, [3, 9]] = torch.tensor([-0.0, 0.0], dtype=torch.bfloat16)
    rows[5, 7] = 1e-40  # a denormal above both zeros of a row of -inf
    for width in (1, 2, 31, 32, 33, 63, 64, 65, 49151, 49152):
        narrow = rows[:, -width:].contiguous()
        assert torch.equal(argmax_kernel.argmax_rows(narrow), narrow.float().argmax(dim=-1)), width
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**15), 2**15, (64, 1000), dtype=torch.int16, generator=gen)
    bits[:32] &= ~0x80  # half the rows without NaNs or infinities (an exponent bit cleared): a number wins
    patterns = bits.view(torch.bfloat16)
    assert torch.equal(argmax_kernel.argmax_rows(patterns), patterns.float().argmax(dim=-1))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_greedy_rows_take_the_argmax(argmax_kernel, use_kernel):
    sampler = Sampler(argmax_kernel if use_kernel else None)
    rows = _rows_with_ties_and_nans()
    tokens, logprobs = sampler.sample(rows, [_req(temperature=0.0) for _ in range(len(rows))])
    assert tokens == rows.argmax(dim=-1).tolist() and logprobs == [None] * len(rows)


def test_bfloat16_logits_sample_as_their_float32_copy(argmax_kernel):
    """A bfloat16 model's logits reach the sampler as they are: greedy rows take their argmax, and a batch with
    logprobs, penalties or sampling works on an exact float32 copy."""
    halves = _rows_with_ties_and_nans()[:3].to(torch.bfloat16)  # ties, a maximum in the last lane; no NaN
    sampler = Sampler(argmax_kernel)
    greedy = [_req(temperature=0.0) for _ in range(3)]
    assert sampler.sample(halves, greedy) == sampler.sample(halves.float(), greedy)

    def mixed():  # fresh requests each time: a seeded request's generator moves as it samples
        reqs = [_req(temperature=0.0, logprobs=2), _req(temperature=0.0, frequency_penalty=1.0),
                _req(temperature=0.7, seed=3)]
        reqs[1].output_token_ids = [7, 7]
        return reqs

    assert sampler.sample(halves, mixed()) == sampler.sample(halves.float(), mixed())


def test_top_k_one_is_greedy_and_penalties_change_the_choice():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    reqs = [
        _req(temperature=1.0, top_k=1, seed=5),
        _req(temperature=0.0, repetition_penalty=10.0, prompt=[1]),
        _req(temperature=0.0, frequency_penalty=2.0),
    ]
    reqs[2].output_token_ids = [1]
    tokens, _ = Sampler().sample(logits, reqs)
    assert tokens == [1, 2, 2]


def test_logit_bias_moves_greedy_and_sampled_choices_but_not_the_reported_logprobs(argmax_kernel):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]] * 4)
    reqs = [
        _req(temperature=0.0),
        _req(temperature=0.0, logit_bias={1: -2.0}, logprobs=1),  # 3 - 2 < 2: token 2 wins
        _req(temperature=0.0, logit_bias={1: -0.5, 3: 1.0}),  # 2.5 > 2.0 and 1.5: token 1 still wins
        _req(temperature=1.0, seed=9, logit_bias={0: -100.0, 1: -100.0, 2: -100.0}),  # only token 3 is left
    ]
    for sampler in (Sampler(argmax_kernel), Sampler()):
        tokens, lps = sampler.sample(logits, reqs)
        assert tokens == [1, 2, 1, 3]
        # Logprobs are the model's own (before bias), as vLLM reports them by default.
        assert lps[1].logprob == pytest.approx(float(logits[1].log_softmax(-1)[2]))
        assert lps[1].top[0][0] == 1
    halves = logits.to(torch.bfloat16)  # a bfloat16 model's logits: biased on their float32 copy
    assert Sampler(argmax_kernel).sample(halves, reqs[:3]) == Sampler(argmax_kernel).sample(halves.float(), reqs[:3])


def test_sampling_follows_the_distribution_and_logprobs_are_reported():
    probs = torch.tensor([0.7, 0.2, 0.1])
    req = _req(temperature=1.0, seed=123, logprobs=2)
    counts = torch.zeros(3)
    for _ in range(3000):
        tokens, lps = Sampler().sample(probs.log().unsqueeze(0), [req])
        counts[tokens[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)
    assert lps[0].top[0][0] == 0 and abs(lps[0].top[0][1] - math.log(0.7)) < 1e-5


def _engine(loaded, max_num_seqs=8):
    return LLMEngine(
        EngineConfig(dtype="float32", scheduler=SchedulerConfig(max_num_seqs, 64), cache=CacheConfig(block_size=4, num_kv_blocks=256)),
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
    kept = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True))])[0]
    assert kept.finish_reason == "stop" and kept.text == text[: text.index(stop) + len(stop)]
    tok = base.token_ids[5]
    by_id = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                      stop_token_ids=[tok]))])[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    # The stop token's text is left out, as a stop string is, unless include_stop_str_in_output keeps it: the texts
    # of the outputs cut by length right before and right after it.
    before, after = (_run(engine, [([3, 4, 5], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))])[0]
                     for n in (len(by_id.token_ids) - 1, len(by_id.token_ids)))
    assert by_id.text == before.text and after.text != before.text
    by_id_kept = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                           stop_token_ids=[tok], include_stop_str_in_output=True))])[0]
    assert by_id_kept.text == after.text


def test_logit_bias_forces_or_bans_tokens_in_the_engine(tiny_llama):
    engine = _engine(tiny_llama)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    base = _run(engine, [([3, 4, 5], greedy)])[0].token_ids
    forced_token = next(t for t in range(10, 100) if t not in base)
    forced, banned = _run(engine, [
        ([3, 4, 5], SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True,
                                   logit_bias={forced_token: 100.0})),
        ([3, 4, 5], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={base[0]: -100.0})),
    ])
    assert forced.token_ids == [forced_token] * 12
    assert banned.token_ids[0] != base[0] and base[0] not in banned.token_ids
    vocab = tiny_llama.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias token ids"):
        engine.add_request([3, 4, 5], SamplingParams(logit_bias={vocab: 1.0}))


def test_min_tokens_holds_back_eos_stop_token_ids_and_stop_strings(tiny_llama):
    engine = _engine(tiny_llama)
    base = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))])[0]
    stop_id = base.token_ids[2]
    early = base.token_ids.index(stop_id)
    by_id = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    assert _run(engine, [([3, 4, 5], by_id)])[0].token_ids == base.token_ids[: early + 1]
    held = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[stop_id], min_tokens=8))])[0]
    assert len(held.token_ids) >= 8 and stop_id not in held.token_ids[:8]
    assert held.token_ids[:early] == base.token_ids[:early] and held.token_ids[early] != stop_id

    # EOS: biased to win at once, it ends the output at one token unless min_tokens holds it back.
    eos = tiny_llama.tokenizer.eos_token_ids[0]
    eager = dict(max_tokens=30, temperature=0.0, logit_bias={eos: 100.0})
    assert _run(engine, [([3, 4, 5], SamplingParams(**eager))])[0].token_ids == [eos]
    patient = _run(engine, [([3, 4, 5], SamplingParams(**eager, min_tokens=6))])[0]
    assert patient.token_ids[:6] == base.token_ids[:6] and patient.token_ids[6:] == [eos]  # 6 tokens, then EOS
    assert patient.finish_reason == "stop"

    # A stop string that the output holds early is not searched for before min_tokens.
    stop_text = base.text[:3]
    cut = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_text],
                                                    min_tokens=10))])[0]
    assert len(cut.token_ids) >= 10 and cut.text.startswith(base.text[:3])


def test_special_tokens_stay_in_the_text_only_when_asked(tiny_llama):
    engine = _engine(tiny_llama)
    eos = tiny_llama.tokenizer.eos_token_ids[0]
    forced = dict(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={eos: 100.0})
    skipped, shown = _run(engine, [([3, 4, 5], SamplingParams(**forced)),
                                   ([3, 4, 5], SamplingParams(**forced, skip_special_tokens=False))])
    assert skipped.token_ids == shown.token_ids == [eos] * 3
    assert skipped.text == "" and shown.text == "<|endoftext|>" * 3


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


def _contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


@pytest.mark.slow
def test_bad_words_never_appear_as_their_tokens(smollm2):
    """vLLM's bad_words: a word's tokens (at a text's start and after a space) never make up the output; the
    one-token word is banned outright, the two-token one only after its first token."""
    llm = LLM(dtype="float32", loaded=smollm2, max_num_seqs=2)
    prompt = "The capital of France is"
    plain = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0))[0].token_ids
    for words in (["Paris"], ["The answer"]):
        sequences = bad_words_token_ids(smollm2.tokenizer, words)
        assert any(_contains(plain, seq) for seq in sequences), "the word must be in the plain output"
        assert max(map(len, sequences)) == (1 if words == ["Paris"] else 2)
        banned = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, bad_words=words))[0].token_ids
        assert not any(_contains(banned, seq) for seq in sequences) and banned != plain
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
