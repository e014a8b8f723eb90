"""Shared fixtures: tiny random models saved to disk (loaded through Loom's own loader) and the bundled SmolLM2.

Hugging Face transformers is the reference; its outputs are computed once per test session.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

from loom.model.loader import LoadedModel, default_model_path, load_model

CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "In machine learning, a transformer is a model built on attention. Once upon a time in a land far away.",
    "Quantum computing differs from classical computing because qubits can be in superposition. 0123456789",
    "Continuous batching keeps every slot busy: finished requests leave and waiting ones join at once.",
]
TINY_VOCAB = 320


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

    torch.manual_seed({"llama": 1, "qwen2": 2, "gpt2": 3}[kind])
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


@pytest.fixture(scope="session", params=["llama", "qwen2", "gpt2"])
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
