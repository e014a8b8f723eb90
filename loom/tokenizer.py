"""Tokenizer on the HF `tokenizers` library: from tokenizer.json, or built from a GGUF's vocabulary and merges.

Incremental detokenization uses tokenizers' DecodeStream, which holds back bytes until they form whole UTF-8
characters, so a streamed delta never carries half a character.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

# GGUF token types (llama.cpp's llama_token_type)
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# GPT-2's split pattern; llama.cpp's "smollm" pre-tokenizer puts single digits in front of it.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    gpt2_split = pre_tokenizers.Split(Regex(_GPT2_PATTERN), behavior="isolated")
    if pre in ("gpt2", "gpt-2", "default"):
        return pre_tokenizers.Sequence([gpt2_split, byte_level])
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2_split, byte_level])
    raise ValueError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: smollm, gpt2, default)")


@dataclass
class Tokenizer:
    """Encode/decode plus what the engine needs to know: BOS, the EOS ids, and the chat template."""

    backend: HFTokenizer
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    add_bos: bool = False  # prepend BOS ourselves (GGUF); tokenizer.json files do it in their post-processor
    chat_template: str | None = None

    @classmethod
    def from_gguf_vocab(
        cls,
        tokens: list[str],
        token_types: list[int],
        merges: list[str],
        pre: str,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> "Tokenizer":
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types)
            if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
        ]
        backend.add_special_tokens(special)
        return cls(backend, bos_token_id, eos_token_ids, add_bos, chat_template)

    @classmethod
    def from_gguf_sentencepiece(
        cls,
        tokens: list[str],
        token_types: list[int],
        unk_token_id: int | None,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> "Tokenizer":
        """Gemma's sentencepiece BPE from a GGUF vocabulary, which lists no merges: spaces written as "▁", byte
        fallback for what the vocabulary lacks, no prefix space. The merges are rebuilt from the vocabulary: a
        token that two others concatenate to is a merge of them, ranked by the token's place in the file (Gemma's
        order of merges; its scores do not follow it), a longer left piece first. A token of spaces only is stored
        with real spaces and is respelled in "▁"."""
        spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        merges = []
        for token in spelled:
            rank = vocab[token]
            for cut in range(len(token) - 1, 0, -1):
                left, right = token[:cut], token[cut:]
                if left in vocab and right in vocab:
                    merges.append((rank, left, right))
        merges.sort(key=lambda m: m[0])
        unk = spelled[unk_token_id] if unk_token_id is not None else None
        backend = HFTokenizer(models.BPE(vocab, [(left, right) for _, left, right in merges], unk_token=unk,
                                         fuse_unk=True, byte_fallback=True))
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, kind in zip(spelled, token_types) if kind == _GGUF_CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, kind in zip(spelled, token_types) if kind == _GGUF_USER_DEFINED])
        return cls(backend, bos_token_id, eos_token_ids, add_bos, chat_template)

    @classmethod
    def from_dir(cls, path: Path, eos_token_ids: list[int]) -> "Tokenizer":
        """tokenizer.json (+ tokenizer_config.json / chat_template.jinja) of a Hugging Face model directory."""
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()

        def token_id(name: str) -> int | None:
            tok = cfg.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        eos = list(eos_token_ids)
        cfg_eos = token_id("eos_token")
        if cfg_eos is not None and cfg_eos not in eos:
            eos.append(cfg_eos)
        return cls(backend, token_id("bos_token"), eos, False, template)

    @classmethod
    def load(cls, path: Path) -> "Tokenizer":
        """Read what `save` wrote."""
        meta = json.loads((path / "loom_tokenizer.json").read_text())
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), **meta)

    def save(self, path: Path) -> None:
        self.backend.save(str(path / "tokenizer.json"))
        meta = {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": self.eos_token_ids,
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
        }
        (path / "loom_tokenizer.json").write_text(json.dumps(meta))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @cached_property
    def _chat_template(self) -> Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API or give one")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            chat_template: str | None = None, template_kwargs: dict | None = None) -> str:
        """Render messages with the model's template in jinja2's sandbox (a template cannot reach Python internals).
        `tools` (OpenAI's function definitions) reach the template as transformers gives them, for templates that
        show the model its tools. `chat_template` replaces the model's for this call; `template_kwargs` are more
        variables for it (say `enable_thinking`), never replacing the ones above.

        `continue_final_message`: the text ends right after the last message's content, with no end-of-turn
        tokens, so that the model carries that message on (a reply begun for it, as vLLM and transformers offer).
        """
        if continue_final_message and (add_generation_prompt or not messages or not messages[-1].get("content")):
            raise ValueError("continue_final_message needs add_generation_prompt false and a last message with content")
        template = self._chat_template if chat_template is None else compile_chat_template(chat_template)
        special = lambda i: self.backend.id_to_token(i) if i is not None else ""  # noqa: E731
        variables = {
            **(template_kwargs or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "bos_token": special(self.bos_token_id),
            "eos_token": special(self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        try:
            rendered = template.render(variables)
        except Exception as e:  # a template is code from the model file or the request: any failure is its input's
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e
        if continue_final_message:
            final = messages[-1]["content"]
            for content in (final, final.strip()):  # a template may trim the content
                end = rendered.rfind(content)
                if end >= 0:
                    return rendered[: end + len(content)]
            raise ValueError("the chat template does not render the last message's content, so it cannot be continued")
        return rendered

    def detokenizer(self, prompt_token_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_token_ids or [], skip_special_tokens)


def compile_chat_template(source: str) -> Template:
    """A chat template compiled in jinja2's sandbox, with transformers' extras (`tojson`, `raise_exception`,
    `strftime_now`, loop controls); ValueError if it does not compile."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from e


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` for chat templates: plain json.dumps, where jinja2's own escapes HTML characters."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, holding back incomplete UTF-8 characters.

    It is primed with the prompt's last tokens so a tokenizer that drops a word's leading space at the start
    of a decode (SentencePiece-style) still spaces the first output token correctly.
    """

    _PRIME_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        prime = prompt_token_ids[-self._PRIME_TOKENS :]
        # A prompt of token ids may end inside a character: primed with those bytes, the stream would hand the
        # prompt's last characters out as the output's first text. Such an output begins with U+FFFD instead.
        while prime and tokenizer.decode(prime, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            prime = prime[:-1]
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""
