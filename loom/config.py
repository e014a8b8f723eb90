"""Engine configuration: validated dataclasses, so a bad setting fails at construction, not mid-run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.cpu import auto_dtype

# The choices of the engine's backend options; their meanings are where each is made (model/attention.py
# make_attention, model/linear.py make_matmul, model/layer_ops.py make_layer_ops, model/kv_quant.py).
ATTENTION_BACKENDS = ("auto", "paged", "sdpa", "reference")
MATMUL_BACKENDS = ("auto", "amx", "packed", "torch")
QUANTIZATIONS = ("auto", "gguf", "none")
LAYER_OPS = ("auto", "fused", "torch")
KV_CACHE_DTYPES = ("auto", "int8")  # "auto": the model's dtype
SPECULATIVE_SCHEDULES = ("constant", "heuristic", "heuristic_transient")  # SpeculativeConfig's

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept 'float32' / 'bfloat16' (or their short names), 'auto' (loom.cpu.auto_dtype) or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        return dtype
    if dtype == "auto":
        dtype = auto_dtype()[0]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class SchedulerConfig:
    """Limits the scheduler keeps on every step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    policy: str = "continuous"  # or "static" (the padded-wave baseline)
    # Latency protection: while other requests decode, prompts longer than max_num_batched_tokens share at most
    # max(long_prefill_chunk_tokens, decoding requests) token-equivalents a step (a prompt token at position p
    # counts 1 + p / the model's attention_keys_per_token); 0 turns this pacing off.
    long_prefill_chunk_tokens: int = 32

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_chunk_tokens < 0:
            raise ValueError(f"long_prefill_chunk_tokens must be >= 0, got {self.long_prefill_chunk_tokens}")
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {self.policy!r}")


@dataclass
class CacheConfig:
    """Paged KV cache size: an explicit block count, or a memory budget in bytes."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    enable_prefix_caching: bool = True  # continuous policy only; the static baseline never shares blocks
    # "auto": K/V in the model's dtype; "int8": int8 codes with a scale per token and KV head (loom/model/kv_quant.py),
    # about half the bytes of bfloat16: more tokens in the same memory and faster decode at long contexts, at the cost
    # of outputs that differ a little from "auto"'s
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is the reserved null block), got {self.num_kv_blocks}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass
class SpeculativeConfig:
    """vLLM's n-gram speculation (prompt lookup): after each token, the tokens that followed the latest earlier
    occurrence of the context's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are proposed, up
    to num_speculative_tokens of them, and the next step checks them all in one forward. Outputs keep their
    distribution (greedy: the same tokens); steps get longer, and fewer."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # vLLM's dynamic speculation: [start, end, k] entries, k drafts at most while start <= running requests <= end
    # (num_speculative_tokens outside every range). A draft's row costs most where many requests run: at 64 a
    # step's matmuls at 128 rows take 20-23 ms against 13 at 64 (docs/benchmarks.md).
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None
    # "constant": every request drafts up to num_speculative_tokens (vLLM). "heuristic" and "heuristic_transient":
    # transformers' schedules of those names (num_assistant_tokens_schedule), per request: two more drafts after a
    # check whose drafts all held, one fewer (not under 1) after one that rejected any, never past
    # num_speculative_tokens. Text that repeats itself grows to the cap; text that drafts miss costs a draft a step.
    # A new request starts where the engine's latest check left its request ("heuristic": the limit persists from
    # request to request, as transformers' persists from call to call), or at 2 ("heuristic_transient"; "heuristic"
    # too before any check).
    num_speculative_tokens_schedule: str = "constant"

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method must be 'ngram' (prompt lookup), got {self.method!r}")
        # No upper bound, as in vLLM: a step's token budget trims what does not fit, and text that repeats holds long
        # drafts (a cap of 32 beat 16 on the mixed workload).
        if type(self.num_speculative_tokens) is not int or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")
        if self.num_speculative_tokens_schedule not in SPECULATIVE_SCHEDULES:
            raise ValueError(f"num_speculative_tokens_schedule must be one of {SPECULATIVE_SCHEDULES}, got "
                             f"{self.num_speculative_tokens_schedule!r}")
        ranges = self.num_speculative_tokens_per_batch_size
        if ranges is not None:
            if not all(isinstance(r, (list, tuple)) and len(r) == 3 and all(type(x) is int for x in r)
                       for r in ranges):
                raise ValueError("num_speculative_tokens_per_batch_size takes [start, end, k] entries of integers, "
                                 f"got {ranges!r}")
            self.num_speculative_tokens_per_batch_size = ranges = sorted(tuple(r) for r in ranges)
            for start, end, k in ranges:
                if not 1 <= start <= end or not 0 <= k <= self.num_speculative_tokens:
                    raise ValueError(f"[{start}, {end}, {k}] needs 1 <= start <= end and 0 <= k <= "
                                     f"num_speculative_tokens ({self.num_speculative_tokens})")
            for (_, end, _), (start, _, _) in zip(ranges, ranges[1:]):
                if start <= end:
                    raise ValueError(f"num_speculative_tokens_per_batch_size's ranges overlap: {ranges}")

    def drafts_for(self, running: int) -> int:
        """The most drafts a request takes while `running` requests run."""
        for start, end, k in self.num_speculative_tokens_per_batch_size or []:
            if start <= running <= end:
                return k
        return self.num_speculative_tokens

    def first_draft_limit(self, latest: int | None) -> int:
        """The most drafts a new request takes in its first check; `latest`: the limit the engine's latest check
        left its request (None before any)."""
        schedule = self.num_speculative_tokens_schedule
        if schedule == "constant":
            return self.num_speculative_tokens
        return latest if schedule == "heuristic" and latest is not None else min(2, self.num_speculative_tokens)

    def next_draft_limit(self, limit: int, drafted: int, accepted: int) -> int:
        """A request's most drafts after a check of `drafted` drafts of which `accepted` held."""
        if self.num_speculative_tokens_schedule == "constant":
            return limit
        return min(self.num_speculative_tokens, limit + 2) if accepted == drafted else max(1, limit - 1)


@dataclass
class EngineConfig:
    """Everything an LLMEngine needs besides the weights."""

    model: str | None = None  # None: the bundled SmolLM2 GGUF
    dtype: torch.dtype | str = "auto"  # "auto": bfloat16 where the CPU multiplies it in hardware (loom/cpu.py)
    max_model_len: int | None = None  # None: the model's own context length
    attention_backend: str = "auto"  # "auto" | "paged" (C++ kernel) | "sdpa" | "reference" (obvious, for tests)
    # "auto" | "amx" (C++ kernel, bfloat16 on AMX-BF16 CPUs) | "packed" (C++ kernel) | "torch"; see make_matmul
    matmul_backend: str = "auto"
    # "gguf": weights that the GGUF file stores in Q4_0 / Q4_1 / Q8_0 blocks stay in them (C++ kernels, on AMX tiles
    # where AMX runs the model; the same bits as "none"); "auto": so where a kernel for them builds; "none": every
    # weight dequantized to `dtype`.
    quantization: str = "auto"
    layer_ops: str = "auto"  # "auto" | "fused" (C++ kernel: norm, RoPE, SwiGLU) | "torch"
    num_threads: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    speculative: SpeculativeConfig | None = None  # None: one token per request per step

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        if self.speculative is not None and self.scheduler.policy != "continuous":
            raise ValueError("speculative decoding needs the continuous policy")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.matmul_backend not in MATMUL_BACKENDS:
            raise ValueError(f"matmul_backend must be one of {MATMUL_BACKENDS}, got {self.matmul_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.layer_ops not in LAYER_OPS:
            raise ValueError(f"layer_ops must be one of {LAYER_OPS}, got {self.layer_ops!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
