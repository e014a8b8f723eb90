"""Prompt logprobs (OpenAI's echo + logprobs, lm-eval's loglikelihood): transformers' log-softmax over the prompt,
whatever the chunking, the batch mix, the prefix cache or a preemption."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_engine

from loom import LLM, SamplingParams
from loom.model.loader import load_model

PROMPTS = [list(range(30, 90)), [5, 17, 42, 99, 7], [250, 3], [9]]


def _run(engine, jobs) -> list:
    ids = [engine.add_request(prompt, params) for prompt, params in jobs]
    finals = engine.run_to_completion()
    return [finals[i] for i in ids]


def test_prompt_logprobs_equal_transformers_log_softmax(tiny_model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    # A 16-token budget splits the 60-token prompt into chunks across steps, beside the other prompts.
    llm = LLM(dtype="float32", loaded=load_model(tiny_model_dir), max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64,
              block_size=8)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3))
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        got = output.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for k in range(1, len(prompt)):
            row = expected[k - 1]  # the logits at position k - 1 score token k
            assert got[k].token_id == prompt[k]
            assert got[k].logprob == pytest.approx(float(row[prompt[k]]), abs=1e-4)
            assert [t for t, _ in got[k].top] == row.topk(3).indices.tolist()
            assert [v for _, v in got[k].top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert output.logprobs == []  # prompt logprobs alone do not ask for the output's


def test_prompt_logprobs_do_not_depend_on_chunks_mix_cache_or_preemption(tiny_llama):
    rng = random.Random(5)
    vocab = tiny_llama.config.vocab_size
    prompt = [rng.randrange(1, vocab) for _ in range(37)]
    wanted = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=1)

    alone = _run(make_engine(tiny_llama, max_num_seqs=1, budget=64, blocks=64, prefix_caching=False),
                 [(prompt, wanted)])[0]
    assert len(alone.prompt_logprobs) == len(prompt)

    # The same prompt computed first by a request without prompt logprobs, so its blocks sit in the prefix cache;
    # then again with them, in chunks of 8 tokens, beside other requests.
    engine = make_engine(tiny_llama, max_num_seqs=4, budget=8, blocks=64)
    _run(engine, [(prompt, SamplingParams(max_tokens=2, temperature=0.0))])
    others = [([rng.randrange(1, vocab) for _ in range(rng.randint(3, 20))],
               SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for _ in range(3)]
    mixed = _run(engine, others[:2] + [(prompt, wanted)] + others[2:])[2]
    assert engine.scheduler.prefix_cache_hits == 0  # the request with prompt logprobs recomputed its prefix

    # A pool too small for all four at once: requests are preempted and recompute their prompts.
    small = make_engine(tiny_llama, max_num_seqs=4, budget=64, blocks=20)
    squeezed = _run(small, [(prompt, wanted)] * 4)
    assert small.scheduler.num_preemptions > 0, "the pool was meant to force a preemption"

    for output in [mixed, *squeezed]:
        assert output.token_ids == alone.token_ids
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        for got, want in zip(output.prompt_logprobs[1:], alone.prompt_logprobs[1:]):
            assert got.token_id == want.token_id and got.top[0][0] == want.top[0][0]
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)


def test_prompt_logprobs_out_of_range_is_a_value_error():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
