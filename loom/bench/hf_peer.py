"""Hugging Face transformers as the peer in `loom bench offline`: static `generate` waves and `generate_batch`."""

from __future__ import annotations

import time

import torch

from loom.bench.workloads import BenchRequest


def load_hf_model(model_path: str | None, dtype: torch.dtype = torch.float32):
    """The same weights through transformers' own loader (GGUF or HF directory), in `dtype`."""
    import transformers

    from loom.model.loader import model_path as resolve

    path = resolve(model_path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs).eval()


def hf_static(model, prompts: list[list[int]], requests: list[BenchRequest], wave: int,
              pad_id: int) -> tuple[float, list[list[int]]]:
    """Waves of `wave` requests, left-padded, each generating to its longest request (exactly, no EOS stop)."""
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for i in range(0, len(prompts), wave):
        batch, reqs = prompts[i : i + wave], requests[i : i + wave]
        width, longest = max(len(p) for p in batch), max(r.max_tokens for r in reqs)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=pad_id)
        outputs += [row[width : width + r.max_tokens].tolist() for row, r in zip(out, reqs)]
    return time.perf_counter() - started, outputs


def hf_continuous(model, prompts: list[list[int]], requests: list[BenchRequest]) -> tuple[float, list[list[int]], int]:
    """transformers' own continuous batching; one max_new_tokens for all, so every request runs to the longest.

    Returns seconds, each request's first max_tokens tokens, and the tokens it generated in all.
    """
    from transformers import GenerationConfig

    longest = max(r.max_tokens for r in requests)
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None)
    started = time.perf_counter()
    result = model.generate_batch(prompts, generation_config=config, warmup=False)
    seconds = time.perf_counter() - started
    ordered = [result[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    return seconds, [o[: r.max_tokens] for o, r in zip(ordered, requests)], sum(len(o) for o in ordered)
