"""The engine's command-line options, shared by `loom serve`, `loom generate` and the benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import json

from loom.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    LAYER_OPS,
    MATMUL_BACKENDS,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def add_engine_args(p: argparse.ArgumentParser, kv_cache_gib: float, one_setting: bool = True) -> None:
    """The engine's options; with `one_setting` False (benchmarks), dtype and quantization come as lists instead."""
    if one_setting:
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="auto: bfloat16 where the CPU has AMX-BF16 or AVX512-BF16, else float32")
        p.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                       help="gguf: keep the file's Q4_0 / Q4_1 / Q8_0 weights in their blocks; none: dequantize "
                            "every weight to --dtype; auto: gguf where its kernel builds")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running set at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens a step computes at most (prompt chunks and decodes)")
    p.add_argument("--long-prefill-chunk-tokens", type=int, default=32,
                   help="while requests decode, a long prompt advances about max(this, decoding requests) tokens a "
                        "step; 0: no pacing")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="refuse prompt + max_tokens beyond this (default: the model's context)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache size in blocks of 16 tokens (instead of --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", type=float, default=kv_cache_gib, help="GiB for the KV cache")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="int8: K/V as int8 with a scale per token and head, about twice the tokens per GiB; auto: "
                        "the model's dtype")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute shared prompt prefixes instead of reusing their cached KV blocks")
    p.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="paged: Loom's C++ kernel; sdpa: torch; reference: the obvious code; auto: paged where it "
                        "builds")
    p.add_argument("--matmul-backend", default="auto", choices=list(MATMUL_BACKENDS),
                   help="amx: bfloat16 on AMX tiles; packed: Loom's C++ kernel; torch: F.linear; auto: amx where "
                        "the CPU has it, else packed")
    p.add_argument("--layer-ops", default="auto", choices=list(LAYER_OPS),
                   help="fused: Loom's C++ kernel for norms, RoPE and SwiGLU; torch: torch ops; auto: fused where "
                        "it builds")
    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='vLLM\'s n-gram speculation, e.g. \'{"num_speculative_tokens": 3}\' (docs/serving.md)')
    p.add_argument("--threads", type=int, default=None, help="threads the kernels use (default: every core)")


def speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig(**json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"not a speculative config: {e}") from None


def speculative_configs(text: str) -> list[SpeculativeConfig | None]:
    """A JSON list of speculative configs, null for none."""
    try:
        items = json.loads(text)
        if not isinstance(items, list) or not items:
            raise ValueError("expected a non-empty JSON list")
        return [None if item is None else SpeculativeConfig(**item) for item in items]
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"not a list of speculative configs: {e}") from None


def engine_config(args: argparse.Namespace, dtype: str | None = None, quantization: str | None = None) -> EngineConfig:
    """The EngineConfig that `_engine_args` describes (dtype and quantization given apart in benchmarks' loops)."""
    return EngineConfig(
        model=getattr(args, "model", None),
        dtype=dtype or args.dtype,
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        matmul_backend=args.matmul_backend,
        quantization=quantization or args.quantization,
        layer_ops=args.layer_ops,
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                  long_prefill_chunk_tokens=args.long_prefill_chunk_tokens),
        cache=CacheConfig(
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=int(args.kv_cache_memory * (1 << 30)),
            enable_prefix_caching=args.prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        speculative=args.speculative_config,
    )


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The `add_engine_args` options of `args` that differ from their defaults, as command-line flags again (to
    start `loom serve` with the settings a benchmark was given)."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser, kv_cache_gib=0.0)
    flags: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help" or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default and action.dest != "kv_cache_memory":
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreFalseAction):
            flags.append(flag)
        elif isinstance(value, SpeculativeConfig):
            flags += [flag, json.dumps(dataclasses.asdict(value))]
        else:
            flags += [flag, str(value)]
    return flags
