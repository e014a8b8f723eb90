"""The tokenizer built from the GGUF matches transformers' tokenizer; streaming never splits a UTF-8 character."""

from __future__ import annotations

import pytest

TEXTS = [
    "The capital of France is",
    "Today's weather is so",
    "Numbers: 12345 and 3.14159, dates 2024-01-02",
    "  leading spaces\tand tabs\n\nnew lines",
    "Unicode: café, naïve, 日本語のテキスト, emoji 🎉🚀, Ελληνικά",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "don't won't they're I'll we've",
]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(smollm2, hf_smollm2, text):
    _, hf_tok = hf_smollm2
    assert smollm2.tokenizer.encode(text) == hf_tok(text).input_ids
    assert smollm2.tokenizer.decode(hf_tok(text).input_ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_never_emits_half_a_character(smollm2, text):
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    detok = tok.detokenizer([504, 3575])
    pieces = [detok.step(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_and_ids(smollm2):
    tok = smollm2.tokenizer
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.encode("<|im_end|>") == [2]
    assert tok.chat_template and "im_start" in tok.chat_template
