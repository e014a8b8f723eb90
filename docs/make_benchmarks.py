"""Run Loom's benchmark commands and write docs/benchmarks.md from their JSON.

    python docs/make_benchmarks.py --run             # every command (about 20 minutes on 2 cores), then the page
    python docs/make_benchmarks.py --run offline     # one of them again, then the page
    python docs/make_benchmarks.py                   # the page from the JSON already in docs/data/

Each command's JSON lines go to docs/data/NAME.jsonl with the machine, date and commit they were measured on; plots
go to docs/img/. The page shows what the JSON holds, nothing typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parent
DATA = DOCS / "data"

RUNS = {
    "offline": "loom bench offline --workload mixed --num-requests 200 --dtypes bfloat16 "
               "--policies static,continuous --plot docs/img",
    "peers": "loom bench offline --workload mixed --num-requests 64 --dtypes float32,bfloat16 --policies continuous "
             "--peers hf --hf-requests 16",
    "serve": "loom bench serve --against-offline --concurrency 1,16,64 --num-requests 128 --plot docs/img",
    "demo": "loom demo --plain --plot docs/img",
    "gemma": "loom bench offline --model gemma-3-270m --workload mixed --num-requests 64 --dtypes bfloat16 "
             "--policies continuous --peers hf --hf-requests 16",
    "gemma_kv": "loom bench perf --model gemma-3-270m --dtypes bfloat16 --figures kv --kv-contexts 512,4096,32768",
    "scale": "loom bench serve --scale-out --num-requests 256 --concurrency 32 --output-len 16,128",
}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    memory_kib = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal")))
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory_kib / (1 << 20)),
            "bfloat16_hardware": [f for f in ("amx_bf16", "avx512_bf16") if f in flags], "torch": torch.__version__,
            "commit": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                     cwd=DOCS).stdout.strip()}


def run(name: str) -> None:
    command = RUNS[name]
    print(f"$ {command}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "loom.cli", *shlex.split(command)[1:]], capture_output=True,
                          text=True, cwd=DOCS.parent)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    meta = {"command": command, "date": datetime.date.today().isoformat(), "exit_code": done.returncode,
            "machine": machine()}
    DATA.mkdir(exist_ok=True)
    (DATA / f"{name}.jsonl").write_text("\n".join(json.dumps(x) for x in [meta, *lines]) + "\n")
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)


def load(name: str) -> tuple[dict, list[dict]] | None:
    path = DATA / f"{name}.jsonl"
    if not path.exists():
        return None
    meta, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    return meta, lines


def header(meta: dict) -> list[str]:
    m = meta["machine"]
    bf16 = ", ".join(m["bfloat16_hardware"]) or "no bfloat16 hardware"
    return [f"`{meta['command']}`", "",
            f"Measured {meta['date']} at {m['commit']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB, "
            f"{bf16}), torch {m['torch']}.", ""]


def table(columns: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
            *("| " + " | ".join(str(x) for x in row) + " |" for row in rows), ""]


def offline_section(meta: dict, lines: list[dict]) -> list[str]:
    runs = [x for x in lines if "system" in x]
    summary = next((x for x in lines if x.get("summary")), {})
    out = ["## Static against continuous batching", "",
           "200 requests, prompts of 20-400 tokens and 16-256 output tokens, greedy with `ignore_eos`, 64 slots, "
           "on one engine in one process. Static batching runs waves of 64 padded to the longest; continuous "
           "batching schedules every step.", "", *header(meta)]
    out += table(["policy", "output tok/s", "seconds", "steps", "TTFT p50 s", "padding tokens", "KV fragmentation",
                  "of matmul peak", "time over roofline"],
                 [[x["system"], x["output_tokens_per_s"], x["seconds"], x["steps"], x["ttft_p50_s"], x["pad_tokens"],
                   f"{100 * x['kv_fragmentation']:.1f}%", f"{100 * x['fraction_of_peak']:.1f}%",
                   f"{x['seconds_over_roofline']}x"] for x in runs])
    if summary:
        out += [f"Continuous over static: **{summary['continuous_over_static']}x**; the static waves spent "
                f"{100 * summary['static_pad_fraction']:.0f}% of their tokens on padding; identical outputs: "
                f"{summary['identical_outputs']}.", ""]
    out += ["![static and continuous slot timelines](img/timeline-mixed-bfloat16-auto.png)", "",
            "![KV cache use per step](img/kv-mixed-bfloat16-auto.png)", ""]
    return out


def peer_row(x: dict) -> list:
    """A `loom bench offline --peers` line's system, its rate (or error), Loom's ratio over it, that ratio's ceiling
    (the peer's time over Loom's memory floor) and whether the outputs were identical to Loom's."""
    return [x["system"], x.get("output_tokens_per_s", x.get("error", "-")), x.get("loom_continuous_over_this", "-"),
            x.get("loom_memory_floor_over_this", "-"), x.get("identical_outputs_to_loom", "-")]


PEER_COLUMNS = ["system", "output tok/s", "Loom over this", "Loom's memory floor over this", "identical outputs"]
FLOOR_NOTE = ("\"Loom's memory floor over this\" is the ratio's ceiling: the peer's time over the time Loom's run "
              "would take if each of its steps only read its weights (as Loom holds them) and its K/V once, at the "
              "read bandwidth measured in the run, and nothing else cost anything.")


def peer_section(title: str, intro: str, meta: dict, lines: list[dict], first_column: str) -> list[str]:
    """A `loom bench offline --peers` run as a section: its systems' lines, each led by its `first_column` field."""
    out = [f"## {title}", "", f"{intro} {FLOOR_NOTE}", "", *header(meta)]
    return out + table([first_column, *PEER_COLUMNS], [[x[first_column], *peer_row(x)] for x in lines])


def peers_section(meta: dict, lines: list[dict]) -> list[str]:
    return peer_section(
        "Loom against transformers",
        "The first 16 requests of the mixed workload, all at once: Loom's continuous batching against transformers' "
        "`generate` (one padded batch, its best here) and `generate_batch` (its own continuous batching), the same "
        "weights in the same process.",
        meta, [x for x in lines if x.get("requests") == 16 and "system" in x], "dtype")


def gemma_section(meta: dict, lines: list[dict]) -> list[str]:
    return peer_section(
        "Gemma 3 270M against transformers",
        "The mixed workload on Gemma 3 270M (GGUF Q4_K_M: q, k, v, gate, up and the LM head run in Q8_0 blocks, o and "
        "half the down projections in Q4_K blocks, the other down projections in Q6_K blocks), bfloat16. transformers "
        "runs the first 16 requests with `generate` (one padded batch) and `generate_batch`, on the same file in the "
        "same process.",
        meta, [x for x in lines if "system" in x], "requests")


def gemma_kv_section(meta: dict, lines: list[dict]) -> list[str]:
    out = ["### The KV cache of one Gemma 3 request", "",
           "One request alone (its prompt in chunks of the 2048-token budget, then one decode step), bfloat16 KV. "
           "Gemma 3 270M's 15 local layers attend to the last 512 positions, its 3 global layers to everything: "
           "the local layers' blocks behind the window go back to the pool as the request moves on. \"One table\" is "
           "what the request would hold with every layer keeping every block. While decoding, the global layers hold "
           "a sixth of that (3 of 18 layers) and the local ones 33 blocks each of their five groups (7.7 MiB) at any "
           "length; during prefill a step's chunk joins the window, so the peak depends on the token budget.", "",
           *header(meta)]
    rows = [[x["context"], x["one_table_kv_mib"], x["peak_kv_mib"], x["decode_kv_mib"],
             f"{100 * x['decode_fraction_of_one_table']:.0f}%"] for x in lines if x.get("figure") == "kv_footprint"]
    return out + table(["context tokens", "one table MiB", "windowed: prefill peak MiB", "windowed: decoding MiB",
                        "decoding of one table"], rows)


def serve_section(meta: dict, lines: list[dict]) -> list[str]:
    out = ["## The server against the engine", "",
           "The mixed workload offline (`LLMEngine` in the benchmark's process), then through a `loom serve` the "
           "command starts with the same settings, over HTTP with streaming (SSE) clients. One stream: the first 12 "
           "requests one at a time, time per output token after the first. N clients: all 128 requests with N in "
           "flight. Client and server share the machine's cores; their CPU seconds are given, the server's split into its "
           "engine thread with its OpenMP workers (the model) and every other thread (HTTP, SSE, the event loop, "
           "tokenizing).", "", *header(meta)]
    rows = []
    for x in lines:
        on, off = x["online"], x["offline"]
        if x["concurrency"] == 1:
            rows.append(["1", f"{off['tpot_ms']['median']:.2f} ms/token", f"{on['tpot_ms']['median']:.2f} ms/token",
                         f"{x['tpot_online_over_offline']:.3f}x time", f"{on['ttft_ms']['median']:.0f} / "
                         f"{on['ttft_ms']['p99']:.0f}", x["client_cpu_s"], x["server_engine_threads_cpu_s"],
                         x["server_other_threads_cpu_s"]])
        else:
            rows.append([str(x["concurrency"]), f"{off['output_token_throughput']:.1f} tok/s",
                         f"{on['output_token_throughput']:.1f} tok/s",
                         f"{x['throughput_online_over_offline']:.3f}x throughput",
                         f"{on['ttft_ms']['median']:.0f} / {on['ttft_ms']['p99']:.0f}", x["client_cpu_s"],
                         x["server_engine_threads_cpu_s"], x["server_other_threads_cpu_s"]])
    out += table(["clients", "offline", "online", "online / offline", "TTFT p50 / p99 ms", "client CPU s",
                  "server CPU s: engine threads", "server CPU s: other threads"], rows)
    workers = sorted({x.get("server_openmp_workers") for x in lines})
    out += [f"OpenMP workers parked in the server after the run: {workers} (one team).", "",
            "![throughput against load](img/serve_throughput.png) ![latency against load](img/serve_latency.png)", ""]
    return out


def scale_section(meta: dict, lines: list[dict]) -> list[str]:
    out = ["## Scale out on Ray Serve", "",
           "One `loom serve` against `loom serve --replicas 2` with each router, each started by the command in turn "
           "with the same engine settings. The tenants workload: 8 tenants, each with its own 500-token system "
           "prompt, 256 chat requests in random order, 32 in flight; the hit rate is the share of prompt tokens "
           "the replicas' prefix caches served, from their /metrics. The mixed workload (20-400 prompt tokens) runs "
           "on the single engine and the first router. Memory: the proportional set size of the server and every "
           "process under it, Ray's included. Client, server and both replicas share the machine's cores.", "",
           *header(meta)]
    rows = [[x["workload"], x["system"], f"{x['output_token_throughput']:.1f}",
             f"{x['ttft_ms']['median']:.0f} / {x['ttft_ms']['p99']:.0f}",
             "-" if x["prefix_cache_hit_rate"] is None else f"{100 * x['prefix_cache_hit_rate']:.1f}%",
             f"{100 * x['hit_rate_of_single']:.1f}%" if "hit_rate_of_single" in x else "-",
             ", ".join(f"{k} {v}" for k, v in sorted(x["routed_by"].items())) or "-",
             " / ".join(map(str, x["requests_per_replica"])) or "-", f"{x['startup_s']:.0f}",
             f"{x['memory_gib']:.2f}"] for x in lines]
    out += table(["workload", "system", "output tok/s", "TTFT p50 / p99 ms", "prefix-cache hits",
                  "of one engine's hits", "routed by", "requests per replica", "start-up s", "memory GiB"], rows)
    mixed = {x["router"]: x for x in lines if x["workload"] == "mixed"}
    replicas = next((x for router, x in mixed.items() if router), None)
    if None in mixed and replicas:
        one = mixed[None]
        ratio = replicas["output_token_throughput"] / one["output_token_throughput"]
        out += [f"On the mixed workload the replicas give {ratio:.2f}x the single engine's throughput, in "
                f"{replicas['memory_gib']:.2f} against {one['memory_gib']:.2f} GiB, up in {replicas['startup_s']:.0f} "
                f"against {one['startup_s']:.0f} s: on one machine the extra processes "
                "(Ray's, and a model and KV cache a replica) cost memory and start-up, and each replica's one "
                "thread runs its steps' matmuls alone.", ""]
    return out


def demo_section(meta: dict, lines: list[dict]) -> list[str]:
    return ["## The article's experiment", "", *header(meta),
            "Six requests on three slots, static against continuous, drawn from the engine's own steps:", "",
            "![the article's six requests](img/demo_timeline.png)", ""]


def render() -> str:
    out = ["# Benchmarks", "",
           "Every figure on this page comes from the JSON of the command above it (docs/data/), written by "
           "`python docs/make_benchmarks.py`; rerun it to measure your machine. The bundled SmolLM2-135M-Instruct "
           "(GGUF Q4_1) is the model in every section but the Gemma 3 one; `--dtype auto` chose bfloat16 where the "
           "table says so.", ""]
    for name, section in (("offline", offline_section), ("peers", peers_section), ("gemma", gemma_section),
                          ("gemma_kv", gemma_kv_section), ("serve", serve_section),
                          ("scale", scale_section), ("demo", demo_section)):
        loaded = load(name)
        if loaded is not None:
            out += section(*loaded)
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs="*", choices=list(RUNS), default=None, help="run these (none named: all)")
    args = parser.parse_args()
    if args.run is not None:
        for name in args.run or list(RUNS):
            run(name)
    (DOCS / "benchmarks.md").write_text(render())


if __name__ == "__main__":
    main()
