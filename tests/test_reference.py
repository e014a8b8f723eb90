"""Greedy outputs equal Hugging Face transformers' `generate` (float32), one prompt at a time."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from loom import LLM, SamplingParams
from loom.demo import ARTICLE_REQUESTS
from loom.model.loader import load_model

TINY_PROMPTS = [
    [5, 17, 42, 99, 7],
    [250, 3],
    [11] * 40,
    list(range(30, 90)),
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
]


@pytest.mark.parametrize(("backend", "matmul", "ops"), [("paged", "packed", "fused"), ("paged", "torch", "fused"),
                                                         ("sdpa", "packed", "torch"), ("reference", "torch", "torch")])
def test_tiny_models_match_transformers(tiny_model_dir, backend, matmul, ops):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    loaded = load_model(tiny_model_dir)
    max_tokens = [30, 60, 20, 45, 25]
    expected = [hf_greedy(hf, p, n, eos_token_id=0) for p, n in zip(TINY_PROMPTS, max_tokens)]
    assert sum(len(e) for e in expected) > 100, "the reference must generate real sequences"

    llm = LLM(dtype="float32", loaded=loaded, max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=64, block_size=8,
              attention_backend=backend, matmul_backend=matmul, layer_ops=ops)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    got = [o.token_ids for o in llm.generate(TINY_PROMPTS, params)]
    assert got == expected


@pytest.fixture(scope="module")
def article_reference(hf_smollm2) -> list[tuple[list[int], list[int]]]:
    """transformers' greedy outputs for the article's prompts: (prompt ids, output ids) each."""
    hf_model, hf_tok = hf_smollm2
    reference = []
    for prompt, cap in ARTICLE_REQUESTS:
        ids = hf_tok(prompt).input_ids
        reference.append((ids, hf_greedy(hf_model, ids, cap, eos_token_id=hf_tok.eos_token_id)))
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_smollm2_article_prompts_match_transformers(smollm2, hf_smollm2, article_reference, quantization):
    """float32 on dequantized weights, and on the GGUF blocks themselves (the quantized kernel's same bits)."""
    _, hf_tok = hf_smollm2
    llm = LLM(dtype="float32", loaded=smollm2, max_num_seqs=3, quantization=quantization)
    outs = llm.generate([p for p, _ in ARTICLE_REQUESTS],
                        [SamplingParams(max_tokens=c, temperature=0.0) for _, c in ARTICLE_REQUESTS])
    for out, (prompt_ids, expected) in zip(outs, article_reference):
        assert out.prompt_token_ids == prompt_ids
        assert out.token_ids == expected
        assert out.text == hf_tok.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 513])
def test_rms_norm_gives_transformers_bits(dtype, rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from loom.model.layer_ops import rms_norm

    gen = torch.Generator().manual_seed(rows)
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(576, generator=gen))
    x = (3 * torch.randn(rows, 576, generator=gen)).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, hf.weight.detach(), 1e-5), hf(x))
