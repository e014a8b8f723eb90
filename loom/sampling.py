"""Per-request sampling parameters, validated so nonsense fails with a ValueError naming the field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Stop strings are searched in new text after every token: bound the work one request can ask for.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value, either sign
MAX_CHOICES = 1024  # strings in a structured output's choice


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and, if asked, the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StructuredOutputParams:
    """A constraint on the output's text, as vLLM's `structured_outputs` names them: exactly one of a JSON schema
    (`json`: a dict or its JSON text), any JSON object (`json_object`), a regular expression (`regex`), one of a
    list of strings (`choice`), or a grammar (`grammar`: Lark, or llama.cpp's GBNF). `disable_any_whitespace`: JSON
    without whitespace between its tokens (a model cannot then pad the output with blank lines)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice and grammar, "
                             f"got {given or 'none'}")
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"json: the schema is not valid JSON ({e})") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"json: a schema must be a JSON object, got {self.json!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not 0 < len(self.choice) <= MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings, "
                                 f"got {self.choice!r:.80}")


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy. Penalties follow the usual conventions: `repetition_penalty` (HF/CTRL style,
    over prompt and output tokens, 1.0 = off), `presence_penalty` and `frequency_penalty` (OpenAI style, over
    output tokens, 0.0 = off). `logit_bias` adds a value in [-100, 100] to a token id's logit before penalties,
    temperature and filters (OpenAI's meaning): -100 all but bans a token, +100 all but forces it.
    """

    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the output keeps the stop string that ended it
    skip_special_tokens: bool = True  # the output text leaves special tokens (e.g. <|im_end|>) out
    logprobs: int | None = None  # number of top alternatives to return per token (0: only the chosen one)
    prompt_logprobs: int | None = None  # the same for each prompt token but the first (no prefix cache hits then)
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: StructuredOutputParams | None = None  # the output follows a JSON schema, regex, grammar...
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be picked
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words the output may not contain (as tokens)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: as many as fit)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_int("top_k", self.top_k, low=-1, high=2**31 - 1)
        if self.top_k == -1:
            self.top_k = 0
        _check_float("top_p", self.top_p, low=0.0, low_open=True, high=1.0)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True, high=100.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if len(self.stop) > MAX_STOP_STRINGS or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings and {MAX_STOP_TOKEN_IDS} stop_token_ids, "
                             f"got {len(self.stop)} and {len(self.stop_token_ids)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop: every stop string must be a non-empty string of at most "
                                 f"{MAX_STOP_STRING_CHARS} characters, got {s!r:.80}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=20)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r:.80}")
        self.logit_bias = dict(self.logit_bias)
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias token id", token, low=0)
            _check_float(f"logit_bias[{token}]", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids!r:.80}")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, low=0)
        self.bad_words = list(self.bad_words)
        if len(self.bad_words) > MAX_STOP_STRINGS or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words: at most {MAX_STOP_STRINGS} words, each a string with more than spaces, got "
                             f"{self.bad_words!r:.80}")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for as many as fit with max_tokens")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputParams, got "
                                 f"{self.structured_outputs!r:.80}")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured outputs: the grammar decides where "
                                 "the output may end")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, a logit bias, a minimum length, bad words, structured outputs or allowed tokens: the row's
        logits may change before it picks a token."""
        return (self.uses_penalties or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words)
                or self.structured_outputs is not None or self.allowed_token_ids is not None)

    @property
    def uses_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_float(
    name: str, value: object, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
