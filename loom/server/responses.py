"""The parts of OpenAI's responses that several endpoints build: logprobs in the legacy and the chat shape, usage."""

from __future__ import annotations

from collections.abc import Sequence

from loom.engine.client import RequestStream
from loom.sampling import TokenLogprob
from loom.tokenizer import Tokenizer


class LogprobFormatter:
    """Token ids and their TokenLogprobs as the responses show them: each token as its own text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: list[int], lps: Sequence[TokenLogprob | None], offset: int) -> dict:
        """OpenAI's legacy logprobs object; an echoed prompt's first token has no logprob (None).

        `top_logprobs` holds the k best tokens and the token that was sampled or scored, up to k + 1 entries, as
        OpenAI's legacy completions and vLLM give them: a client looks the chosen token up there."""
        tokens = [self.text(token_id) for token_id in token_ids]
        tops: list[dict[str, float] | None] = []
        for lp in lps:
            top: dict[str, float] | None = None
            if lp is not None:
                top = {}
                for token_id, value in lp.top:  # best first; two ids may share a text: keep the better one
                    top.setdefault(self.text(token_id), value)
                top.setdefault(self.text(lp.token_id), lp.logprob)
            tops.append(top)
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat(self, lps: Sequence[TokenLogprob]) -> dict:
        """The chat shape: each token with its text, logprob and bytes, and its k best alternatives."""
        def entry(token_id: int, logprob: float) -> dict:
            text = self.text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in lps]}


def joined_logprobs(parts: list[dict]) -> dict:
    """Legacy logprobs objects one after the other (an echoed prompt's, then the completion's)."""
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}


def usage(streams: list[RequestStream], n: int, completion_tokens: int) -> dict:
    """Token counts of a response whose streams hold n samples of each prompt, in order."""
    prompt_tokens = sum(len(s.prompt_token_ids) for s in streams[::n])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
