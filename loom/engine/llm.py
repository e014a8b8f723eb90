"""LLM: offline generation for many prompts at once, on an LLMEngine it drives to completion."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from loom.engine.engine import LLMEngine
from loom.engine.outputs import RequestOutput
from loom.model.loader import LoadedModel
from loom.sampling import SamplingParams


class LLM:
    """`LLM(model).generate(prompts, params)` -> one finished RequestOutput per prompt, in prompt order."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        policy: str = "continuous",
        long_prefill_chunk_tokens: int = 32,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int = 1 << 30,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        matmul_backend: str = "auto",
        quantization: str = "auto",
        layer_ops: str = "auto",
        num_threads: int | None = None,
        enable_prefix_caching: bool = True,
        speculative_config: dict | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        """`speculative_config`: vLLM's, e.g. {"method": "ngram", "num_speculative_tokens": 3} (SpeculativeConfig)."""
        config = EngineConfig(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            attention_backend=attention_backend,
            matmul_backend=matmul_backend,
            quantization=quantization,
            layer_ops=layer_ops,
            num_threads=num_threads,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, policy, long_prefill_chunk_tokens),
            cache=CacheConfig(block_size, num_kv_blocks, kv_cache_memory, enable_prefix_caching),
            speculative=SpeculativeConfig(**speculative_config) if speculative_config is not None else None,
        )
        self.engine = LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Queue every prompt (validating all first), step until all finish, return outputs in prompt order.

        `priority`: one per prompt, lower runs first (FCFS within a priority); all 0 by default.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                ids.append(self.engine.add_request(prompt, p, priority=prio))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finished = self.engine.run_to_completion()
        return [finished[rid] for rid in ids]
