"""Structured outputs: a request's JSON schema, regex, choice or grammar compiled by llguidance into a matcher that
names, before each token, the tokens that keep the output inside its language, and follows the tokens chosen."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from loom.sampling import StructuredOutputParams
from loom.tokenizer import Tokenizer


def _grammar(params: StructuredOutputParams) -> str:
    """llguidance's grammar text for the one constraint that `params` holds; ValueError for one it cannot read."""
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        overrides = {"whitespace_flexible": False} if params.disable_any_whitespace else None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", params.choice)
    return llguidance.grammar_from("grammar", params.grammar)  # Lark as it is, GBNF converted to Lark


@dataclass
class GrammarMatcher:
    """One request's place in its grammar: the tokens allowed next, as a bitmask of `num_words` int32 words."""

    matcher: llguidance.LLMatcher
    num_words: int

    def fill_bitmask(self, words: torch.Tensor) -> None:
        """Bit t of `words` (int32, contiguous, `num_words` long) set where token t may come next."""
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), self.num_words * 4)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token, which the bitmask allowed."""
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar rejected token {token_id}: {self.matcher.get_error()}")

    @property
    def is_complete(self) -> bool:
        """The output is a whole sentence of the grammar and nothing may follow it."""
        return self.matcher.is_stopped()


def forbidden_tokens(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: the tokens each matcher forbids next."""
    words = torch.zeros(len(matchers), matchers[0].num_words, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(words[row])
    # The words are little-endian, so unpacking their bytes little bit first keeps token order.
    bits = np.unpackbits(~words.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size]).bool()


class GrammarCompiler:
    """Compiles StructuredOutputParams into matchers over one model's vocabulary. llguidance's view of the tokenizer
    is built on first use (0.2 s for SmolLM2's 49,152 tokens), under a lock: requests are created on many threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._num_tokens = max(vocab_size, tokenizer.vocab_size)
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None

    def _vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._num_tokens,
                    eos_token=self._tokenizer.eos_token_ids or None)
            return self._lltokenizer

    def compile(self, params: StructuredOutputParams) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar; ValueError (naming the problem) for a schema, regex or
        grammar that does not compile."""
        try:
            grammar = _grammar(params)
        except ValueError as e:
            raise ValueError(f"structured outputs: {e}") from None
        matcher = llguidance.LLMatcher(self._vocabulary(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs: {matcher.get_error()}")
        return GrammarMatcher(matcher, -(-self._num_tokens // 32))
