"""The tokenizer built from the GGUF matches transformers' tokenizer and chat template; streaming never splits a UTF-8
character."""

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


CHATS = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour, "}],  # a trailing space: kept, as transformers keeps it
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers_also_continuing_the_last_message(smollm2, hf_smollm2, messages):
    _, hf_tok = hf_smollm2
    tok = smollm2.tokenizer
    for add_generation_prompt in (True, False):
        assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == \
            hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    continued = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert continued == hf_tok.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert continued.endswith(messages[-1]["content"])
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template(messages, continue_final_message=True)  # with the generation prompt


def test_a_prompt_cut_inside_a_character_lends_the_output_none_of_its_text(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("Unicode: 日本語", add_special_tokens=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the last character's bytes are split over tokens
    detok = tok.detokenizer(ids[:-1])
    tail = [detok.step(t) for t in tok.encode(" hello world", add_special_tokens=False)]
    assert "".join(tail) == " hello world"
    detok = tok.detokenizer(ids[:-1])
    assert "".join(detok.step(t) for t in ids[-1:] + tok.encode(" ok", add_special_tokens=False)) == "\ufffd ok"
