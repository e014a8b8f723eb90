"""Offline API: bad input fails clearly for that request only; LLM.generate returns outputs with timings; the demo."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from loom import LLM, EngineConfig, LLMEngine, SamplingParams
from loom.config import CacheConfig, SchedulerConfig
from loom.demo import ARTICLE_REQUESTS, run_demo
from loom.engine.kv_cache import BlockPool


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(dtype="float32", loaded=tiny_llama, max_num_seqs=4, num_kv_blocks=64, block_size=8)


def test_bad_input_raises_and_nothing_is_left_behind(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="KV cache holds at most"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=410))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 10**6]])
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], SamplingParams(temperature=-1))
    # A bad prompt among good ones: nothing of the batch is left queued.
    with pytest.raises(ValueError):
        llm.generate(["fine prompt", ""])
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    out = llm.generate(["still serving"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_allowed_token_ids_keep_the_argmax_where_it_is_allowed_and_nothing_else(llm):
    prompt = [5, 17, 42, 99, 7]
    plain = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].token_ids
    allowed = sorted(set(plain) | {3, 250})
    kept = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                 allowed_token_ids=allowed))[0].token_ids
    assert kept == plain  # every greedy pick was allowed, so none changes
    few = [3, 250, 311]
    outs = llm.generate([prompt] * 3, [SamplingParams(max_tokens=20, temperature=t, seed=1, ignore_eos=True,
                                                      allowed_token_ids=few) for t in (0.0, 1.0, 2.0)])
    assert all(set(o.token_ids) <= set(few) for o in outs) and len(set(outs[2].token_ids)) > 1
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[320]))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    prompt = list(range(30, 90))
    params = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    cut = llm.generate([prompt], SamplingParams(**params, truncate_prompt_tokens=12))[0]
    assert cut.prompt_token_ids == prompt[-12:]
    assert cut.token_ids == llm.generate([prompt[-12:]], SamplingParams(**params))[0].token_ids
    too_long = [5] * 600  # beyond the tiny model's 512 positions until -1 cuts it to what fits with max_tokens
    roomy = LLM(dtype="float32", loaded=llm.engine.loaded, num_kv_blocks=80, block_size=8)
    assert len(roomy.generate([too_long], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))[0]
               .prompt_token_ids) == 508
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_generate_returns_text_tokens_reason_and_timings(llm):
    outs = llm.generate(["The capital of France is", "Once upon a time"],
                        [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                         SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [5, 2]
    for o in outs:
        assert o.finished and o.finish_reason == "length"
        # A random model may end on half a UTF-8 character: the stream never emits it.
        assert o.text == llm.tokenizer.decode(o.token_ids).rstrip("\ufffd")
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="fifo")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16")
    with pytest.raises(ValueError, match="layer_ops"):
        EngineConfig(dtype="float32", layer_ops="fast")
    with pytest.raises(ValueError, match="matmul_backend"):
        EngineConfig(dtype="float32", matmul_backend="blas")
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8")


def test_block_pool_ref_counts_and_double_free():
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.share(a)
    pool.free(a)
    assert pool.num_free_blocks == 2
    pool.free(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.free(a)
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_demo_logs_draws_and_agrees(tiny_llama):
    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_kv_blocks=256)), tiny_llama)
    console = Console(record=True, no_color=True, width=200)
    static, continuous = run_demo(engine, console)
    log = console.export_text()
    assert static.texts == continuous.texts
    assert continuous.figures[0] == 1 and len(continuous.figures) == 2
    assert static.pad_tokens > 0 and continuous.pad_tokens == 0
    assert continuous.steps < static.steps
    assert log.count("<- admit req") == 2 * len(ARTICLE_REQUESTS)
    assert "PREFILL + DECODE fused in one pass" in log and "batch barrier" in log
    assert "identical text in both runs: yes" in log


def test_cli_generate_prints_the_completion(tiny_llama_dir, capsys):
    from loom.cli import main

    assert main(["generate", "The capital of France is", "--model", str(tiny_llama_dir), "--max-tokens", "4"]) == 0
    expected = LLM(dtype="float32", model=str(tiny_llama_dir)).generate(
        ["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))[0].text
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "", "--model", str(tiny_llama_dir)]) == 2  # a clear error, not a traceback


def test_an_engine_that_loads_its_own_model_keeps_one_copy_of_the_weights(tiny_llama_dir, tiny_llama):
    own = LLM(dtype="float32", model=str(tiny_llama_dir), num_kv_blocks=64, block_size=8)
    shared = LLM(dtype="float32", loaded=tiny_llama, num_kv_blocks=64, block_size=8)
    assert own.engine.loaded.weights == {}  # consumed while the model was built from them
    assert tiny_llama.weights, "weights passed in by the caller stay usable for other engines"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert own.generate([[5, 6, 7]], params)[0].token_ids == shared.generate([[5, 6, 7]], params)[0].token_ids


def test_bfloat16_keeps_bf16_kv_and_agrees_with_float32_on_smollm2(smollm2):
    prompt = ["The capital of France is"]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    bf16 = LLM(loaded=smollm2, dtype="bfloat16", num_kv_blocks=32)
    assert bf16.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert bf16.generate(prompt, params)[0].text.startswith(" Paris")


@pytest.mark.parametrize("flags, expected", [({"amx_bf16", "avx512f"}, torch.bfloat16),
                                             ({"avx512f", "avx512_bf16"}, torch.bfloat16),
                                             ({"avx512f", "avx2"}, torch.float32), (set(), torch.float32)])
def test_dtype_auto_is_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch, flags, expected):
    import loom.cpu

    monkeypatch.setattr(loom.cpu, "cpu_flags", lambda: flags)
    assert EngineConfig(dtype="auto").dtype == expected
    assert EngineConfig().dtype == expected  # the default
    assert EngineConfig(dtype="float32").dtype == torch.float32  # pinned stays pinned
    assert loom.cpu.auto_dtype()[0] == str(expected).removeprefix("torch.")


def test_engine_flags_give_loom_serve_the_same_engine():
    from loom.cli import build_parser
    from loom.engine_args import engine_config, engine_flags

    bench = build_parser().parse_args([
        "bench", "serve", "--against-offline", "--dtype", "bfloat16", "--max-num-seqs", "8", "--no-prefix-caching",
        "--kv-cache-memory", "0.5", "--speculative-config", '{"num_speculative_tokens": 4}', "--threads", "2"])
    serve = build_parser().parse_args(["serve", *engine_flags(bench)])
    assert engine_config(serve) == engine_config(bench)
