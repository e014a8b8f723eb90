"""`loom generate | demo | bench offline`."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from loom.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, LAYER_OPS, MATMUL_BACKENDS, EngineConfig
from loom.engine_args import add_engine_args, engine_config, speculative_configs
from loom.server import KEEP_ALIVE_SECONDS

ROUTER_NAMES = ("prefix", "pow2", "round_robin")  # loom/distributed/router.py's


def _chat_template(value: str) -> str:
    from pathlib import Path

    from loom.tokenizer import compile_chat_template

    path = Path(value)
    template = path.read_text() if "{" not in value and path.is_file() else value
    try:
        compile_chat_template(template)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return template


def cmd_generate(args: argparse.Namespace) -> int:
    from loom.engine.llm import LLM
    from loom.sampling import SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or [],
    )
    out = llm.generate([args.prompt], params)[0]
    print(out.text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from loom.demo import run_demo
    from loom.engine.engine import LLMEngine

    console = Console(no_color=args.plain, soft_wrap=True, highlight=False)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads))
    static, continuous = run_demo(engine, console)
    if args.plot:
        from loom.bench.plots import slot_timeline
        from loom.demo import NUM_SLOTS

        path = slot_timeline({"static": static.trace, "continuous": continuous.trace}, NUM_SLOTS,
                             f"{args.plot}/demo_timeline.png", "the article's six requests on 3 slots")
        console.print(f"wrote {path}")
    return 0 if static.texts == continuous.texts else 1


def cmd_serve(args: argparse.Namespace) -> int:
    import ipaddress
    import logging
    import signal

    import uvicorn

    from loom.cpu import auto_dtype
    from loom.engine.async_engine import AsyncEngine
    from loom.engine.engine import LLMEngine
    from loom.server.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("loom.server")
    if args.replicas is not None:
        try:
            from loom.distributed.launch import connect, default_threads_per_replica, start_replicas
        except ImportError as e:
            raise ValueError(f"--replicas needs Ray Serve: pip install 'loom[ray]' ({e})") from e
        connect(args.ray_address)
        threads = args.threads_per_replica or default_threads_per_replica(args.replicas, args.max_replicas_per_node)
        client = start_replicas(engine_config(args), args.replicas, threads, args.router, args.max_replicas_per_node,
                                args.max_waiting, args.request_timeout)
        model_name = client.info.model_name
    else:
        # The engine thread builds the model: every parallel region then runs on that one thread (async_engine.py).
        client = AsyncEngine(lambda: LLMEngine(engine_config(args)), max_waiting=args.max_waiting,
                             request_timeout=args.request_timeout)
        why = f" ({auto_dtype()[1]})" if args.dtype == "auto" else ""
        log.info("engine: %s%s", client.engine.describe(), why)
        model_name = client.engine.loaded.name
    if args.chat_template is not None:
        client.tokenizer.chat_template = args.chat_template  # before any request has compiled the model's
    name = args.served_model_name or model_name
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback and not args.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this port can use the model", args.host)
    app = create_app(client, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     open_metrics=args.open_metrics, trust_request_chat_template=args.trust_request_chat_template,
                     enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler it found: make that a no-op so
    # a clean drain exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=args.keep_alive_timeout)
    return 0


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from loom.bench.offline import main as bench_main

    return bench_main(args)


def cmd_bench_perf(args: argparse.Namespace) -> int:
    from loom.bench.perf import main as bench_main

    return bench_main(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.scale_out:
        from loom.bench.scale_out import main as bench_main
    elif args.against_offline:
        from loom.bench.against_offline import main as bench_main
    else:
        from loom.bench.serve_client import main as bench_main

    return bench_main(args)


def _int_pair(text: str) -> list[int]:
    low, high = (int(x) for x in text.split(","))
    return [low, high]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Continuous-batching LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--model", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the CPU has AMX-BF16 or AVX512-BF16, else float32")
    g.add_argument("--threads", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="the article's static vs continuous experiment on the bundled model")
    d.add_argument("--plain", action="store_true", help="no colour (for logs); also automatic when not a terminal")
    d.add_argument("--plot", metavar="DIR", default=None, help="write the static vs continuous timeline PNG here")
    d.add_argument("--model", default=None, help="a .gguf file, an HF model directory, or a packaged model's name")
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the CPU has AMX-BF16 or AVX512-BF16, else float32")
    d.add_argument("--threads", type=int, default=None)
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: bundled SmolLM2 on 127.0.0.1:8000)")
    s.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, an HF model directory, or a packaged model: smollm2-135m (default), "
                        "gemma-3-270m")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (beyond loopback, set --api-key)")
    s.add_argument("--port", type=int, default=8000, help="port to bind")
    add_engine_args(s, kv_cache_gib=1.0)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    s.add_argument("--open-metrics", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--max-waiting", type=int, default=None, help="refuse with 503 + Retry-After beyond this queue")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get a 413")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take from arrival; past it, a 504")
    s.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the file's name)")
    s.add_argument("--chat-template", type=_chat_template, default=None, metavar="FILE_OR_TEMPLATE",
                   help="a jinja chat template (a file, or the template itself) in place of the model's")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let chat and tokenize requests bring their own chat_template (templates are code)")
    s.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (vLLM's; lm-eval's remote tokenizer reads it)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    s.add_argument("--replicas", type=int, default=None,
                   help="serve from this many engine replicas on Ray Serve (pip install 'loom[ray]')")
    s.add_argument("--ray-address", default=None,
                   help="with --replicas: the Ray cluster to join ('auto': the one `ray start` made here; default: "
                        "a local Ray instance)")
    s.add_argument("--threads-per-replica", type=int, default=None,
                   help="with --replicas: kernel threads of each replica (default: a node's cores / its replicas)")
    s.add_argument("--router", default="prefix", choices=ROUTER_NAMES,
                   help="with --replicas: prefix (cache affinity; least loaded when queues are uneven), pow2, "
                        "round_robin")
    s.add_argument("--max-replicas-per-node", type=int, default=None, help="with --replicas: at most this many a node")
    s.add_argument("--keep-alive-timeout", type=float, default=KEEP_ALIVE_SECONDS,
                   help="seconds an idle keep-alive connection stays open (above httpx's 5 s, so a client never "
                        "sends on a closing one)")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    off = bsub.add_parser("offline", help="static vs continuous, fp32 and bf16, on one engine; JSON lines")
    off.add_argument("--workload", choices=["article", "mixed", "shared-prefix", "all"], default="all",
                     help="all: article and mixed")
    off.add_argument("--num-requests", type=int, default=200)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--dtypes", default="float32,bfloat16")
    off.add_argument("--quantizations", default="auto", help="each dtype runs with each: auto, gguf, none")
    off.add_argument("--policies", default="static,continuous")
    off.add_argument("--peers", choices=["none", "hf"], default="none",
                     help="hf: transformers generate / generate_batch in each dtype, on the first --hf-requests")
    off.add_argument("--hf-requests", type=int, default=16, help="the peer runs on this many first requests")
    off.add_argument("--sweep", default=None, metavar="KEY=V1,V2", help="e.g. max_num_seqs=1,4,16,64 (continuous)")
    off.add_argument("--speculative-configs", type=speculative_configs, default=None, metavar="JSON_LIST",
                     help='speculation settings run in turn with the continuous policy, e.g. \'[null, '
                          '{"num_speculative_tokens": 5}]\' (null: none); each setting\'s median against the first\'s')
    off.add_argument("--rounds", type=int, default=1, help="rounds of --speculative-configs, each setting once a round")
    off.add_argument("--plot", metavar="DIR", default=None, help="timeline, KV usage and sweep PNGs")
    off.add_argument("--trace", metavar="DIR", default=None, help="Chrome trace-event JSON per run")
    off.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: bundled SmolLM2)")
    add_engine_args(off, kv_cache_gib=4.0, one_setting=False)
    off.set_defaults(func=cmd_bench_offline)

    pf = bsub.add_parser("perf", help="roofline figures: matmul peak, decode, prefill and draft-checking steps, "
                                      "memory, KV footprint; JSON lines")
    pf.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: bundled SmolLM2)")
    pf.add_argument("--dtypes", default="float32,bfloat16")
    pf.add_argument("--figures", default="peak,decode,prefill,verify,interference,memory,agreement")
    pf.add_argument("--interference-budgets", default="128,256,512", help="max_num_batched_tokens values to try")
    pf.add_argument("--interference-pacing", default="32,0",
                    help="long_prefill_chunk_tokens values to try with each budget (0: no pacing)")
    pf.add_argument("--context", type=int, default=512, help="prompt tokens of each request in the decode figure")
    pf.add_argument("--decode-batches", default="1,64", help="running requests in the decode figure")
    pf.add_argument("--prefill-tokens", type=int, default=2048)
    pf.add_argument("--verify-batch", type=int, default=64, help="running requests in the verify figure")
    pf.add_argument("--verify-drafts", default="0,1,3,5", help="drafts each request checks a step, one run each")
    pf.add_argument("--kv-cache-memory", type=float, default=3.0, help="GiB")
    pf.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                    help="the KV cache of every figure's engine; the agreement figure's float32 run keeps auto")
    pf.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS))
    pf.add_argument("--matmul-backend", default="auto", choices=list(MATMUL_BACKENDS))
    pf.add_argument("--quantizations", default="auto", help="each dtype runs with each: auto, gguf, none")
    pf.add_argument("--layer-ops", default="auto", choices=list(LAYER_OPS))
    pf.add_argument("--agreement-requests", type=int, default=16, help="mixed requests run in both dtypes")
    pf.add_argument("--kv-contexts", default="512,4096",
                    help="tokens of the one request in each kv figure (figure 'kv', not run by default)")
    pf.add_argument("--threads", type=int, default=None)
    pf.set_defaults(func=cmd_bench_perf)

    sv = bsub.add_parser("serve", help="online benchmark client for any OpenAI-compatible server")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000")
    sv.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--workload", default="mixed", help="article, mixed, or a JSONL file of {prompt, max_tokens}")
    sv.add_argument("--num-requests", type=int, default=200)
    sv.add_argument("--prompt-len", type=_int_pair, default=[20, 400], metavar="LOW,HIGH")
    sv.add_argument("--output-len", type=_int_pair, default=[16, 256], metavar="LOW,HIGH")
    sv.add_argument("--tokenizer-model", default=None, help="model whose tokenizer builds the mixed prompts")
    sv.add_argument("--concurrency", default=None, help="clients at once; a list (1,8,32) runs a sweep")
    sv.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (seeded)")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--slo-ttft-ms", type=float, default=None)
    sv.add_argument("--slo-tpot-ms", type=float, default=None)
    sv.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    sv.add_argument("--plot", metavar="DIR", default=None, help="throughput / latency vs concurrency PNGs")
    sv.add_argument("--against-offline", action="store_true",
                    help="run the mixed workload offline, then start `loom serve` (with the engine options below) "
                         "and run it online at each --concurrency (default 1,64); prints the ratios")
    sv.add_argument("--scale-out", action="store_true",
                    help="start one `loom serve`, then `loom serve --replicas` with each of --routers, and run a "
                         "tenants workload (and the mixed one on the first two) through each; hit rates, routing, "
                         "memory")
    sv.add_argument("--replicas", type=int, default=2, help="with --scale-out: engine replicas")
    sv.add_argument("--routers", default="prefix,pow2,round_robin", help="with --scale-out: routers run in turn")
    sv.add_argument("--tenants", type=int, default=8, help="with --scale-out: tenants with their own system prompt")
    sv.add_argument("--system-tokens", type=int, default=500, help="with --scale-out: tokens of each system prompt")
    sv.add_argument("--serve-model", default=None,
                    help="with --against-offline or --scale-out: the model (.gguf, HF directory or packaged model's "
                         "name; default: bundled SmolLM2)")
    sv.add_argument("--single-stream-requests", type=int, default=12,
                    help="with --against-offline: the first requests of the workload, run one at a time")
    add_engine_args(sv, kv_cache_gib=1.0)
    sv.set_defaults(func=cmd_bench_serve)
    return parser


def flag_table(command: str) -> str:
    """A Markdown table of `loom COMMAND`'s options from the parser itself (the README's, between its markers)."""
    parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif isinstance(action, argparse._StoreFalseAction):
            default = "on"
        else:
            default = "–" if action.default is None else f"`{action.default}`"
        rows.append(f"| `{action.option_strings[0]}` | {default} | {action.help} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
