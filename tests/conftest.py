"""Shared fixtures: tiny random models saved to disk (loaded through Loom's own loader) and the bundled SmolLM2.

Hugging Face transformers is the reference; its outputs are computed once per test session.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loom import LLMEngine, SamplingParams
from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.model.loader import LoadedModel, default_model_path, load_model
from loom.model.quantized import QuantizedWeight
from loom.model.vml_dispatch import settle_vml_dispatch

CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "In machine learning, a transformer is a model built on attention. Once upon a time in a land far away.",
    "Quantum computing differs from classical computing because qubits can be in superposition. 0123456789",
    "Continuous batching keeps every slot busy: finished requests leave and waiting ones join at once.",
]
TINY_VOCAB = 320
GGML_TYPES = {name: GGMLQuantizationType[name.upper()] for name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")}


def _train_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def _save_tiny(kind: str, path: Path) -> Path:
    """A seeded random HF model of the given family, saved as safetensors + config + tokenizer."""
    import transformers

    torch.manual_seed({"llama": 1, "qwen2": 2, "gpt2": 3, "gemma3": 4, "qwen3": 5, "llama3": 6}[kind])
    common = dict(vocab_size=TINY_VOCAB, eos_token_id=0, bos_token_id=0)
    if kind == "llama":  # GQA, tied embeddings
        cfg = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
            initializer_range=0.2, **common,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":  # q/k/v bias, untied head, no GQA grouping of 1
        cfg = transformers.Qwen2Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
            initializer_range=0.2, rope_theta=1000.0, **common,
        )
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "qwen3":  # q/k head norms before RoPE, no bias, a head_dim of its own
        cfg = transformers.Qwen3Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2, **common,
        )
        model = transformers.Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises the norms to one; make them matter
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.3)
    elif kind == "llama3":  # Llama 3.1's RoPE scaling, its band placed inside the tiny model's frequencies
        cfg = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **common,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "gemma3":  # local layers on a window shorter than most test prompts, q/k norms, GeGLU, tied head
        cfg = transformers.Gemma3TextConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, sliding_window=6, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], initializer_range=0.2,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
            pad_token_id=0, **common,
        )
        model = transformers.Gemma3ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises the norms to zero, (1 + 0) = 1; make them matter
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0, 0.3)
    else:
        cfg = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.2, **common,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _train_tokenizer(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def settled_vml_dispatch() -> None:
    """MKL's vector math kernels chosen on one thread before any test's torch math, so that a test's first cos or
    exp on two threads (transformers' reference forward, say) cannot run MKL's low-accuracy kernel
    (loom/model/vml_dispatch.py)."""
    settle_vml_dispatch()


@pytest.fixture(scope="session", params=["llama", "qwen2", "gpt2", "gemma3", "qwen3", "llama3"])
def tiny_model_dir(request, tmp_path_factory) -> Path:
    return _save_tiny(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return _save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir) -> LoadedModel:
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own GGUF path (~20-30 s): the reference model and tokenizer, loaded once."""
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model.eval()
    return model, tokenizer


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """transformers `generate`, one prompt at a time, greedy: the output token ids."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
    return out[0, len(prompt_ids) :].tolist()


# --- engine drivers shared by the batching and prefix-caching tests ------------------------------------------


def make_engine(loaded, max_num_seqs=4, budget=64, blocks=128, block_size=4, policy="continuous", backend="paged",
                prefix_caching=True, long_prefill_chunk_tokens=32, kv_cache_dtype="auto"):
    config = EngineConfig(dtype="float32", 
        attention_backend=backend,
        scheduler=SchedulerConfig(max_num_seqs, budget, policy, long_prefill_chunk_tokens),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=blocks, enable_prefix_caching=prefix_caching,
                          kv_cache_dtype=kv_cache_dtype),
    )
    return LLMEngine(config, loaded)


def random_workload(rng: random.Random, n: int, vocab: int) -> list[tuple[list[int], int]]:
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))], rng.randint(1, 24)) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def alone_runner(loaded, blocks: int = 128) -> Callable[[list[int], int], list[int]]:
    """Each request run alone (no prefix cache), each answer kept: the ground truth every batch mix must reproduce."""
    engine = make_engine(loaded, max_num_seqs=1, blocks=blocks, prefix_caching=False)
    cache: dict[tuple, list[int]] = {}

    def run_alone(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            rid = engine.add_request(prompt, greedy(max_tokens))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        cache[key] = out.token_ids
        return cache[key]

    return run_alone


@pytest.fixture(scope="session")
def alone_outputs(tiny_llama):
    return alone_runner(tiny_llama)


def drive(engine: LLMEngine, workload, arrivals: list[int], check_steps: bool = True) -> dict[int, list[int]]:
    """Add request i at step arrivals[i]; step until done; check per-step scheduler invariants on the way."""
    cfg = engine.config.scheduler
    done: dict[int, list[int]] = {}
    ids: dict[str, int] = {}
    violations: list[str] = []

    def observe(out, result, outputs, seconds):
        engine.pool.check_invariants()
        n_tokens = out.num_scheduled_tokens
        if cfg.policy == "continuous" and n_tokens > cfg.max_num_batched_tokens:
            violations.append(f"step {out.step}: {n_tokens} tokens > budget")
        if len(engine.scheduler.running) > cfg.max_num_seqs:
            violations.append(f"step {out.step}: {len(engine.scheduler.running)} running > max_num_seqs")
        # Every running request in its decode phase gets its token every step (no starvation by prompts).
        scheduled = {s.request.request_id for s in out.scheduled}
        for r in engine.scheduler.running:
            if r.num_computed_tokens >= r.num_prompt_tokens and r.request_id not in scheduled and not out.preempted:
                violations.append(f"step {out.step}: decode of {r.request_id} skipped")

    if check_steps:
        engine.step_observers.append(observe)
    step = 0
    pending = sorted(range(len(workload)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            ids[engine.add_request(workload[i][0], greedy(workload[i][1]), request_id=str(i))] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        step += 1
    assert not violations, violations[:5]
    return done


def random_k_quant_blocks(fmt: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Random Q4_K, Q5_K or Q6_K super-blocks (gguf cannot quantize to them): float16 d (and dmin) of varied size,
    every sub-block scale (and min) and every code drawn at random."""
    rng = np.random.default_rng(seed)
    n = out_features * in_features // 256
    size = {"q4_k": 144, "q5_k": 176, "q6_k": 210}[fmt]
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    d = (rng.uniform(1e-4, 0.05, n) * rng.choice([1, 30], n)).astype(np.float16).view(np.uint8).reshape(n, 2)
    if fmt == "q6_k":
        blocks[:, 208:210] = d * (rng.random((n, 1)) < 0.9)  # d, or now and then 0.0
        blocks[:, 209] |= (rng.random(n) < 0.3).astype(np.uint8) << 7  # some d negative
    else:
        blocks[:, 0:2] = d
        blocks[:, 2:4] = rng.uniform(0, 0.02, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(out_features, -1)


def random_quantized(fmt: str, out_features: int, in_features: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight quantized by gguf's own code (K-quants: random blocks), and what gguf dequantizes it to."""
    if fmt.endswith("_k"):
        blocks = random_k_quant_blocks(fmt, out_features, in_features, seed)
        dense = np.asarray(dequantize(blocks, GGMLQuantizationType[fmt.upper()]), dtype=np.float32)
        return QuantizedWeight(fmt, torch.from_numpy(blocks)), torch.from_numpy(dense.reshape(out_features, -1))
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    blocks = quantize(w, GGML_TYPES[fmt])
    dense = torch.from_numpy(np.asarray(dequantize(blocks, GGML_TYPES[fmt]), dtype=np.float32))
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(blocks))), dense


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's (and so the kernels') thread count set to n inside the block, restored after it, failing or not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
