"""Benchmark arithmetic on hand-made records, the serve client against a real server, traces and plots."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest
import torch
from test_server import running_server

from loom import EngineConfig, LLMEngine, SamplingParams
from loom.bench.memory_roofline import read_bandwidth, run_roofline, weight_bytes
from loom.bench.plots import kv_usage, slot_timeline, throughput_vs
from loom.bench.serve_client import run_benchmark
from loom.bench.stats import RequestRecord, distribution, summarize
from loom.bench.workloads import BenchRequest, jsonl_workload, tenants_workload
from loom.config import CacheConfig, SchedulerConfig
from loom.engine.trace import StepRecord, StepTracer
from loom.model.linear import make_matmul


def test_distribution_percentiles():
    d = distribution([1.0, 2.0, 3.0, 4.0, 10.0], scale=1.0)
    assert d == {"mean": 4.0, "median": 3.0, "p90": pytest.approx(7.6), "p99": pytest.approx(9.76)}
    assert distribution([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_summary_throughput_latency_and_goodput():
    records = [
        # TTFT 0.1 s, 5 tokens, last at 0.5 s: TPOT (0.5 - 0.1) / 4 = 0.1 s
        RequestRecord(start=0.0, end=0.5, output_tokens=5, prompt_tokens=10, first_token=0.1,
                      chunk_times=[0.1, 0.2, 0.3, 0.4, 0.5]),
        # TTFT 1.0 s, 3 tokens: TPOT 0.5 s
        RequestRecord(start=0.0, end=2.0, output_tokens=3, prompt_tokens=20, first_token=1.0,
                      chunk_times=[1.0, 1.5, 2.0]),
        RequestRecord(start=0.0, end=0.1, error="HTTP 503"),
    ]
    s = summarize(records, duration=2.0, slo_ttft_ms=500, slo_tpot_ms=200)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["output_token_throughput"] == 4.0 and s["total_token_throughput"] == 19.0
    assert s["request_throughput"] == 1.0
    assert s["ttft_ms"]["mean"] == pytest.approx(550.0)
    assert s["tpot_ms"]["median"] == pytest.approx(300.0)
    assert s["itl_ms"]["median"] == pytest.approx(100.0) and s["itl_ms"]["mean"] == pytest.approx(1.4 / 6 * 1000)  # 4 x 0.1 s and 2 x 0.5 s
    assert s["e2e_ms"]["p99"] == pytest.approx(1985.0)
    assert s["goodput"] == 0.5  # only the first request meets both SLOs


def test_jsonl_workload(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"prompt": [1, 2], "max_tokens": 4}\n')
    assert jsonl_workload(f) == [BenchRequest("hi", 3), BenchRequest([1, 2], 4)]
    f.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        jsonl_workload(f)


def test_serve_client_against_a_real_server(tiny_llama):
    requests = [BenchRequest("Once upon a time", 5 + i) for i in range(6)] + [BenchRequest([5, 6, 7], 4)]
    with running_server(tiny_llama) as (base, _):
        records, duration = asyncio.run(run_benchmark(base, requests, concurrency=3))
        poisson, _ = asyncio.run(run_benchmark(base, requests[:3], request_rate=50.0, seed=1))
    assert all(r.ok for r in records + poisson), [r.error for r in records]
    assert [r.output_tokens for r in records] == [r.max_tokens for r in requests]
    s = summarize(records, duration)
    assert s["completed"] == 7 and s["output_tokens"] == sum(r.max_tokens for r in requests)
    assert s["ttft_ms"]["median"] > 0 and s["tpot_ms"]["median"] > 0


def test_trace_has_one_event_per_step_and_plots_are_written(tiny_llama, tmp_path):
    engine = LLMEngine(EngineConfig(dtype="float32", scheduler=SchedulerConfig(3, 64, "static"), cache=CacheConfig(num_kv_blocks=64)),
                       tiny_llama)
    traces = {}
    for policy in ("static", "continuous"):
        engine.set_scheduler(SchedulerConfig(3, 64, policy))
        tracer = StepTracer(engine)
        with engine.observing(tracer):
            for n in (3, 9, 4, 6):
                engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        traces[policy] = tracer.records
        trace = json.loads(tracer.save_chrome_trace(tmp_path / f"{policy}.json").read_text())
        assert len(trace["traceEvents"]) == steps
        assert all(e["ph"] == "X" and e["dur"] >= 0 for e in trace["traceEvents"])
    assert any(u.kind == "padding" for r in traces["static"] for u in r.slots)
    assert not any(u.kind == "padding" for r in traces["continuous"] for u in r.slots)
    paths = [
        slot_timeline(traces, 3, tmp_path / "timeline.png"),
        kv_usage(traces, tmp_path / "kv.png"),
        throughput_vs([1, 8, 32], {"loom": [10.0, 50.0, 90.0]}, "clients", "tok/s", tmp_path / "t.png", "t"),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_offline_line_reports_roofline_and_fragmentation(tiny_llama):
    from loom.bench.offline import run_once

    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(block_size=4, num_kv_blocks=64)), tiny_llama)
    requests = [BenchRequest([5, 6, 7, 8, 9], 6), BenchRequest([1, 2, 3], 11)]
    line, tokens, _ = run_once(engine, requests, "continuous", 2, 64)
    assert [len(t) for t in tokens] == [6, 11] and line["output_tokens"] == 17
    assert line["model_gflops"] > 0
    # Per step, the unfilled tail of each request's last block of 4 slots is the only waste.
    assert 0 < line["kv_fragmentation"] < 0.75


def test_tracer_counts_each_filled_kv_slot_once(tiny_llama):
    # Blocks of 4; B shares A's first two blocks through the prefix cache, and both end in partly filled blocks.
    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(block_size=4, num_kv_blocks=64)), tiny_llama)
    tracer = StepTracer(engine)
    expected, per_request = [], []

    def filled_slots(*_) -> None:  # every computed token's (block, offset), as a set
        running = engine.scheduler.running
        expected.append(len({(engine.kv.block_tables(r)[0][p // 4], p % 4) for r in running for p in range(r.num_computed_tokens)}))
        per_request.append(sum(r.num_computed_tokens for r in running))

    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with engine.observing(tracer), engine.observing(filled_slots):
        engine.add_request(list(range(1, 11)), params)
        engine.step()
        engine.add_request(list(range(1, 9)) + [20, 21, 22], params)
        engine.run_to_completion()
    assert [r.tokens_in_cache for r in tracer.records] == expected
    assert any(shared < total for shared, total in zip(expected, per_request))  # a block counted once for two
    assert any(n % 4 for n in expected)


def _record(prefill: int, decode: int, sampled: int, in_cache: int) -> StepRecord:
    return StepRecord(step=0, start=0.0, duration=0.0, prefill_tokens=prefill, decode_tokens=decode, pad_tokens=0,
                      sampled_tokens=sampled, num_scheduled=0, running=0, waiting=0, blocks_used=0, blocks_total=0,
                      tokens_in_cache=in_cache)


def test_roofline_takes_each_steps_slower_side():
    # A peak of 1 FLOP/s; 10 params a token in the layers, 100 in the head, 3 bytes of weights, 2 bytes of K/V a
    # token.
    long_prefill = _record(prefill=50, decode=0, sampled=1, in_cache=50)  # 2 * (500 + 100) = 1200 FLOPs, 203 bytes
    decode = _record(prefill=0, decode=2, sampled=2, in_cache=40)  # 2 * (20 + 200) = 440 FLOPs, 87 bytes
    r = run_roofline([long_prefill, decode], 10, 100, weights=3, kv_bytes_per_slot=2, kv_bytes_per_token=2,
                     peak_flops=1.0, bandwidth=0.1)
    assert r["matmul_flops"] == 1640
    assert r["roofline_compute_seconds"] == pytest.approx(1640) and r["roofline_memory_seconds"] == pytest.approx(2900)
    assert r["roofline_seconds"] == pytest.approx(2030 + 870)  # memory-bound both: 203 / 0.1 and 87 / 0.1
    assert r["memory_bound_step_share"] == 1.0
    r = run_roofline([long_prefill, decode], 10, 100, weights=3, kv_bytes_per_slot=2, kv_bytes_per_token=2,
                     peak_flops=1.0, bandwidth=1.0)
    assert r["roofline_seconds"] == pytest.approx(1200 + 440) and r["memory_bound_step_share"] == 0.0
    r = run_roofline([long_prefill, decode], 10, 100, weights=3, kv_bytes_per_slot=2, kv_bytes_per_token=2,
                     peak_flops=1.0, bandwidth=0.18)
    assert r["roofline_seconds"] == pytest.approx(1200 + 87 / 0.18) and r["memory_bound_step_share"] == 0.5
    # Two KV cache groups of 3 layers: a filled slot holds one group's 3 layers, a new token is written in all 6.
    grouped = run_roofline([decode], 10, 100, weights=3, kv_bytes_per_slot=1, kv_bytes_per_token=2, peak_flops=1.0,
                           bandwidth=1.0)
    assert grouped["roofline_memory_seconds"] == pytest.approx(3 + 40 * 1 + 2 * 2)


def test_weight_bytes_and_read_bandwidth(tiny_llama):
    model = tiny_llama.build(torch.float32, make_matmul("torch"))
    cfg = tiny_llama.config
    assert weight_bytes(model) == 4 * (cfg.layer_matmul_params + cfg.lm_head_params)
    assert read_bandwidth(nbytes=32 << 20, repeats=2) > 1e8  # bytes/s; any machine reads 100 MB/s


def test_shared_prefix_workload_shares_its_system_prompt(smollm2):
    from loom.bench.workloads import shared_prefix_workload

    requests = shared_prefix_workload(smollm2.tokenizer, 4, system_tokens=300)
    prompts = [r.prompt for r in requests]
    common = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    assert 300 <= common < 330 and all(len(p) > common for p in prompts)


def test_tenants_workload_gives_each_tenant_its_own_long_prefix(smollm2):
    requests = tenants_workload(smollm2.tokenizer, tenants=3, system_tokens=200, num_requests=30, seed=1)
    firsts: dict[tuple[int, ...], list[list[int]]] = {}
    for request in requests:
        firsts.setdefault(tuple(request.prompt[:150]), []).append(request.prompt)
    assert len(firsts) == 3  # three tenants, and no two share their first 150 tokens
    order = [list(firsts).index(tuple(r.prompt[:150])) for r in requests]
    assert order != sorted(order)  # interleaved, not one tenant after another
    for prompts in firsts.values():
        shared = min(next((i for i, (a, b) in enumerate(zip(p, prompts[0])) if a != b), len(p)) for p in prompts[1:])
        assert shared >= 200


def test_perf_figures_on_a_tiny_model(tiny_llama):
    from loom.bench.matmul_timing import shape_gflops
    from loom.bench.perf import (
        decode_step,
        matmul_peak,
        prefill,
        prefill_interference,
        verify_steps,
    )

    engine = LLMEngine(EngineConfig(dtype="float32", scheduler=SchedulerConfig(8, 256), cache=CacheConfig(num_kv_blocks=256,
                                                                                         enable_prefix_caching=False)),
                       tiny_llama)
    model = engine.runner.model
    peak = matmul_peak(model, rows_options=(8, 64))
    assert peak["peak_gflops"] > 0 and set(peak["gflops_by_rows_all_shapes"]) == {8, 64}
    rows, out_features, in_features = peak["peak_rows_shape"]
    assert rows in (8, 64) and (out_features, in_features) in {(lin.out_features, lin.in_features)
                                                               for lin in [*model.layer_linears(), model.lm_head]}
    decode = decode_step(engine, batch=4, context=20, bandwidth=1e10)
    assert decode["batch"] == 4 and decode["step_ms"] > 0 and decode["matmuls_alone_ms"] > 0
    # Forward and logits are timed inside the very steps timed whole, so what is left outside is never negative.
    assert 0 < decode["forward_ms"] < decode["step_ms"] and 0 <= decode["outside_forward_share"] < 1
    assert len(decode["step_over_matmuls_by_round"]) == decode["rounds"]
    # 4 requests of 20 prompt tokens, each with one or more tokens decoded: their K/V on top of the weights.
    weights, kv_per_token = weight_bytes(engine.runner.model), engine.runner.kv_spec.bytes_per_token
    assert decode["matmuls_memory_floor_ms"] == round(weights / 1e10 * 1e3, 2)
    assert (weights + 4 * 21 * kv_per_token) / weights <= decode["memory_floor_step_over_matmuls"] < 1 + (
        4 * 30 * kv_per_token) / weights
    assert 0 <= decode["metadata_ms"] < decode["step_ms"]
    # The K/V read rates the step got beside its matmuls and would need in a step of twice its matmuls: bytes over
    # the times reported (GB/s = bytes / ms / 1e6), which are rounded to 0.01 ms.
    kv = decode["kv_bytes"]
    assert 4 * 21 * kv_per_token <= kv < 4 * 30 * kv_per_token

    def within_rounding(gbps: float, ms: float, roundings: int) -> bool:
        slack = 0.005 * roundings
        return kv / (ms + slack) / 1e6 - 0.005 <= gbps <= kv / max(ms - slack, 1e-9) / 1e6 + 0.005

    assert within_rounding(decode["kv_gbps_for_twice_matmuls"], decode["matmuls_alone_ms"], 1)
    assert within_rounding(decode["kv_gbps_beside_matmuls"], decode["step_ms"] - decode["matmuls_alone_ms"], 2)
    pre = prefill(engine, 100, peak["peak_gflops"], repeats=1)
    assert pre["prompt_tokens"] == 100 and pre["fraction_of_peak"] > 0 and "fraction_of_round_peak" not in pre
    # Held to the peak's own matmul timed again after each prompt: each round's fraction is its own prompt's FLOP/s
    # over its own peak, and the figure is their median.
    pre = prefill(engine, 100, peak["peak_gflops"], repeats=3, round_peak=lambda: shape_gflops(model, *peak[
        "peak_rows_shape"]))
    flops = 2.0 * (100 * engine.model_config.layer_matmul_params + engine.model_config.lm_head_params)
    by_round = [flops / ms * 1e3 / 1e9 / p for ms, p in zip(pre["ms_by_round"], pre["round_peak_gflops_by_round"])]
    assert len(pre["fraction_of_round_peak_by_round"]) == 3 and all(p > 0 for p in pre["round_peak_gflops_by_round"])
    assert pre["fraction_of_round_peak_by_round"] == pytest.approx(by_round, rel=0.02, abs=2e-3)
    assert pre["fraction_of_round_peak"] == pytest.approx(statistics.median(by_round), rel=0.02, abs=2e-3)
    drafts_before = engine.num_draft_tokens
    checks = verify_steps(engine, batch=4, context=20, drafts=(0, 2), rounds=3)
    assert engine.num_draft_tokens - drafts_before >= 4 * 2 * 4  # 2 drafts a request in each timed step and one more
    assert checks["rows_by_drafts"] == {0: 4, 2: 12} and all(ms > 0 for ms in checks["step_ms_by_drafts"].values())
    assert checks["step_over_no_drafts"][0] == 1.0 and engine.config.speculative is None and engine.proposer is None
    assert not engine.has_unfinished_requests()
    unpaced = prefill_interference(engine, budget=16, long_prefill_chunk_tokens=0, decoding=3, context=8,
                                   long_prompt=60)
    assert unpaced["prefill_steps"] == 5 and unpaced["itl_p99_ratio"] > 0  # 13 prompt tokens beside 3 decodes
    paced = prefill_interference(engine, budget=16, long_prefill_chunk_tokens=4, decoding=3, context=8, long_prompt=60)
    assert paced["prefill_steps"] >= 15 and paced["itl_p99_ratio"] > 0  # at most max(4, 3 decoding) tokens a step
    assert not engine.has_unfinished_requests() and engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_offline_run_holds_itself_to_its_own_matmul_peak(tiny_llama_dir, capsys):
    from loom.cli import main

    assert main(["bench", "offline", "--model", str(tiny_llama_dir), "--workload", "article",
                 "--dtypes", "float32", "--quantizations", "auto,none", "--policies", "continuous",
                 "--kv-cache-memory", "0.05"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]  # one dtype, two quantizations, one policy
    assert [line["quantization"] for line in lines] == ["auto", "none"]
    for line in lines:
        assert line["system"] == "loom-continuous" and line["matmul_peak_gflops"] > 0
        assert line["matmul_backend"] != "quantized"  # a Hugging Face directory has no GGUF blocks
        assert line["fraction_of_peak"] == round(line["model_gflops"] / line["matmul_peak_gflops"], 3)
        assert line["matmul_peak_gflops"] == max(line["matmul_peak_before_after_gflops"]) > 0
        assert line["read_bandwidth_gbps"] > 0 and line["roofline_seconds"] > 0
        # Each step takes the longer of its two sides, so the run's roofline is between the larger sum and both.
        longer = max(line["roofline_compute_seconds"], line["roofline_memory_seconds"])
        both = line["roofline_compute_seconds"] + line["roofline_memory_seconds"]
        assert longer - 1e-4 <= line["roofline_seconds"] <= both + 1e-4
        assert line["seconds_over_roofline"] == pytest.approx(line["seconds"] / line["roofline_seconds"], rel=0.05)
        assert 0 < line["roofline_fraction_of_peak"] <= 1


def test_transformers_as_the_peer_gives_loom_the_same_tokens_and_a_ceiling(tiny_llama_dir, capsys):
    """--peers hf in float32: transformers' generate and generate_batch on the same first requests give Loom's
    tokens; each ratio is Loom's rate over the peer's, and its ceiling the peer's time over Loom's memory floor."""
    from loom.cli import main

    assert main(["bench", "offline", "--model", str(tiny_llama_dir), "--workload", "mixed", "--num-requests", "6",
                 "--dtypes", "float32", "--policies", "continuous", "--kv-cache-memory", "0.05", "--peers", "hf",
                 "--hf-requests", "3"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    loom, static, batch = lines[1:]  # after the policy's own run on all 6
    assert loom["system"] == "loom-continuous(subset)" and loom["requests"] == 3
    assert 0 < loom["roofline_memory_seconds"] < loom["seconds"]
    assert static["system"] == "hf-generate-static" and static["identical_outputs_to_loom"]
    for peer in (static, batch):
        if "error" in peer:  # generate_batch is version-dependent: reported, not failed
            continue
        seconds = peer["output_tokens"] / peer["output_tokens_per_s"]
        assert peer["loom_continuous_over_this"] == pytest.approx(
            loom["output_tokens_per_s"] / peer["output_tokens_per_s"], rel=0.02)
        assert peer["loom_memory_floor_over_this"] == pytest.approx(seconds / loom["roofline_memory_seconds"],
                                                                    rel=0.02)
        assert peer["loom_memory_floor_over_this"] > peer["loom_continuous_over_this"]


def test_offline_runs_speculation_settings_in_rounds_against_the_first(tiny_llama_dir, capsys):
    from loom.cli import main

    configs = '[null, {"num_speculative_tokens": 4, "num_speculative_tokens_schedule": "heuristic"}]'
    assert main(["bench", "offline", "--model", str(tiny_llama_dir), "--workload", "article",
                 "--dtypes", "float32", "--policies", "continuous", "--kv-cache-memory", "0.05",
                 "--speculative-configs", configs, "--rounds", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()][1:]  # after the policy's own run
    runs, summaries = lines[:4], lines[4:]
    assert [(r["round"], r["speculative_config"] is None) for r in runs] == [(0, True), (0, False), (1, True),
                                                                            (1, False)]
    assert all(r["spec_draft_tokens"] == 0 for r in runs[::2]) and all(r["spec_draft_tokens"] > 0 for r in runs[1::2])
    assert runs[1]["speculative_config"]["num_speculative_tokens_schedule"] == "heuristic"
    assert [s["summary"] and s["identical_outputs_to_first"] for s in summaries] == [True, True]
    for summary, mine in zip(summaries, (runs[::2], runs[1::2])):
        rates = [r["output_tokens_per_s"] for r in mine]
        assert summary["output_tokens_per_s_by_round"] == rates
        assert summary["output_tokens_per_s_median"] == pytest.approx(sum(rates) / 2, abs=0.01)
    assert summaries[0]["over_first"] == 1.0
    assert summaries[1]["over_first"] == pytest.approx(summaries[1]["output_tokens_per_s_median"]
                                                       / summaries[0]["output_tokens_per_s_median"], abs=1e-3)


def test_bad_speculative_config_lists_are_refused():
    from loom.cli import build_parser

    for bad in ("[]", '{"num_speculative_tokens": 3}', '[{"num_speculative_tokens": 0}]', "[not json"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "offline", "--speculative-configs", bad])


def test_agreement_runs_both_dtypes_on_the_given_backends_and_kv_cache(tiny_llama, monkeypatch):
    from loom.bench import perf

    built: list[EngineConfig] = []

    class RecordingEngine(LLMEngine):
        def __init__(self, config, loaded):
            built.append(config)
            super().__init__(config, loaded)

    monkeypatch.setattr(perf, "LLMEngine", RecordingEngine)
    monkeypatch.setattr(perf, "mixed_workload", lambda tokenizer, n: [BenchRequest([5, 6, 7, 8], 6)] * n)
    config = EngineConfig(dtype="float32", attention_backend="reference", layer_ops="torch", quantization="none",
                          cache=CacheConfig(num_kv_blocks=64, kv_cache_dtype="int8"))
    result = perf.dtype_agreement(tiny_llama, 3, config)
    assert [c.dtype for c in built] == [torch.float32, torch.bfloat16]
    assert all((c.attention_backend, c.layer_ops, c.quantization) == ("reference", "torch", "none") for c in built)
    assert [c.cache.kv_cache_dtype for c in built] == ["auto", "int8"]  # the float32 reference keeps its own dtype
    assert result["requests"] == 3 and result["tokens"] == 18
    assert 0 <= result["position_agreement"] <= 1 and 0 <= result["identical_requests"] <= 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_on_gguf_blocks_is_also_held_to_the_dense_peak(smollm2, dtype):
    """Blocks trade arithmetic for bytes, so their own matmul peak is below the dense one: the benchmarks measure the
    same weights dequantized too (the same backend family: packed beside the quantized kernel, AMX beside AMX
    blocks), and a model without blocks has no twin."""
    from loom.bench.matmul_timing import dense_twin, matmul_backend_name

    cache = CacheConfig(num_kv_blocks=16)
    blocks = LLMEngine(EngineConfig(dtype=dtype, quantization="gguf", cache=cache), smollm2)
    twin = dense_twin(smollm2, blocks)
    pairs = {"quantized": "packed", "amx_quantized": "amx"}
    assert twin is not None and twin.dtype == blocks.runner.model.dtype
    assert matmul_backend_name(twin) == pairs[matmul_backend_name(blocks.runner.model)]
    assert dense_twin(smollm2, LLMEngine(EngineConfig(dtype=dtype, quantization="none", cache=cache), smollm2)) is None


@pytest.mark.slow
def test_bench_serve_against_offline_runs_one_workload_both_ways(tiny_llama_dir, capsys, tmp_path):
    from loom.cli import main

    assert main(["bench", "serve", "--against-offline", "--serve-model", str(tiny_llama_dir), "--dtype", "float32",
                 "--num-requests", "6", "--single-stream-requests", "2", "--concurrency", "1,4",
                 "--prompt-len", "5,20", "--output-len", "4,8", "--kv-cache-memory", "0.05",
                 "--plot", str(tmp_path)]) == 0
    assert (tmp_path / "serve_throughput.png").stat().st_size > 0 and (tmp_path / "serve_latency.png").exists()
    single, concurrent = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert (single["concurrency"], single["requests"], concurrent["concurrency"], concurrent["requests"]) == (1, 2, 4, 6)
    for row in (single, concurrent):
        assert row["online"]["completed"] == row["requests"] and row["online"]["failed"] == 0 and not row["errors"]
        # CPU seconds come in clock ticks (10 ms): a tiny model's two requests can take less than one.
        assert row["dtype"] == "float32" and row["client_cpu_s"] >= 0 and row["server_engine_threads_cpu_s"] >= 0
        assert row["server_cpu_s"] == pytest.approx(row["server_engine_threads_cpu_s"]
                                                    + row["server_other_threads_cpu_s"], abs=0.02)
        assert row["online"]["ttft_ms"]["p99"] > 0
    assert single["server_engine_threads_cpu_s"] + concurrent["server_engine_threads_cpu_s"] > 0
    assert single["tpot_online_over_offline"] == pytest.approx(
        single["online"]["tpot_ms"]["median"] / single["offline"]["tpot_ms"]["median"], abs=1e-3)
    assert concurrent["throughput_online_over_offline"] == pytest.approx(
        concurrent["online"]["output_token_throughput"] / concurrent["offline"]["output_token_throughput"], abs=1e-3)
