"""POST /v1/completions: OpenAI's legacy completions, with echo and prompt scoring as vLLM and lm-eval use them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from loom.engine.client import EngineClient
from loom.engine.outputs import RequestOutput
from loom.sampling import TokenLogprob
from loom.server.errors import APIError
from loom.server.protocol import CompletionRequest
from loom.server.responses import LogprobFormatter, joined_logprobs, usage
from loom.server.streaming import DONE, add_streams, collect_unless_disconnected, merged, sse, sse_with_errors


def _choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


class CompletionServing:
    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client, self.model_name = client, model_name
        self.logprobs = LogprobFormatter(client.tokenizer)

    async def create(self, body: CompletionRequest, raw: Request) -> dict | StreamingResponse:
        try:
            prompts = body.prompts()
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            # Echo with max_tokens 0 scores a prompt without continuing it (vLLM's echo without generation): the
            # engine samples one token, which the answer leaves out.
            echo_only = body.echo and max_tokens == 0
            max_tokens = 1 if echo_only else max_tokens
            if body.logprobs is not None and not 0 <= body.logprobs <= 20:
                raise ValueError("logprobs must be between 0 and 20")
            prompt_logprobs = body.logprobs if body.echo else None
            body.sampling_params(max_tokens, body.logprobs, prompt_logprobs)  # validate once before queueing
        except ValueError as e:
            raise APIError(400, str(e)) from e
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await add_streams(
            self.client, prompts, body.n,
            lambda i: body.sampling_params(max_tokens, body.logprobs, prompt_logprobs, seed_offset=i), rid,
            body.priority)
        tokenizer = self.client.tokenizer
        echo_texts = [(p if isinstance(p, str) else tokenizer.decode(p)) if body.echo else ""
                      for p in prompts for _ in range(body.n)]
        response = _CompletionResponse(self, body, rid, echo_texts, echo_only, prompt_logprobs is not None)
        if not body.stream:
            return response.whole(await collect_unless_disconnected(raw, streams), streams)
        return StreamingResponse(sse_with_errors(response.events(streams)), media_type="text/event-stream")


class _CompletionResponse:
    """One request's answer, whole or as events."""

    def __init__(self, serving: CompletionServing, body: CompletionRequest, rid: str, echo_texts: list[str],
                 echo_only: bool, scores_prompt: bool) -> None:
        self.serving, self.body, self.echo_texts, self.echo_only = serving, body, echo_texts, echo_only
        self.scores_prompt = scores_prompt
        self.base = {"id": rid, "object": "text_completion", "created": int(time.time()),
                     "model": serving.model_name}

    def output_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        return self.serving.logprobs.completion([lp.token_id for lp in lps], lps, offset)

    def echo_logprobs(self, o: RequestOutput) -> dict | None:
        """The echoed prompt's tokens scored, as OpenAI's echo with logprobs gives them."""
        if o.prompt_logprobs is None:
            return None
        return self.serving.logprobs.completion(o.prompt_token_ids, o.prompt_logprobs, 0)

    def whole(self, finals: dict[int, RequestOutput], streams: list) -> dict:
        choices = []
        for i in range(len(streams)):
            o = finals[i]
            text, lps, reason = ("", [], "length") if self.echo_only else (o.text, o.logprobs, o.finish_reason)
            logprobs = self.output_logprobs(lps, len(self.echo_texts[i]))
            echoed = self.echo_logprobs(o)
            if echoed is not None and logprobs is not None:
                logprobs = joined_logprobs([echoed, logprobs])
            choices.append(_choice(i, self.echo_texts[i] + text, logprobs, reason))
        completion_tokens = 0 if self.echo_only else sum(len(o.token_ids) for o in finals.values())
        return {**self.base, "choices": choices, "usage": usage(streams, self.body.n, completion_tokens)}

    async def events(self, streams: list) -> AsyncIterator[str]:
        body, base = self.body, self.base
        sent_lps = [0] * len(streams)
        text_pos = [len(t) for t in self.echo_texts]
        completion_tokens = 0
        # An echo with logprobs waits for the prompt's scores, which come with the choice's first output.
        echo_waits = [self.scores_prompt] * len(streams)
        if body.echo and not self.scores_prompt:
            for i, t in enumerate(self.echo_texts):
                yield sse({**base, "choices": [_choice(i, t, None, None)]})
        async for i, o in merged(streams):
            if echo_waits[i]:
                echo_waits[i] = False
                yield sse({**base, "choices": [_choice(i, self.echo_texts[i], self.echo_logprobs(o), None)]})
            if self.echo_only:
                if o.finished:
                    yield sse({**base, "choices": [_choice(i, "", self.output_logprobs([], text_pos[i]), "length")]})
                continue
            completion_tokens += len(o.new_token_ids)
            lps: list[TokenLogprob] = []
            if body.logprobs is not None:
                lps = o.logprobs[sent_lps[i]:]
                sent_lps[i] = len(o.logprobs)
            if o.new_text or lps or o.finished:
                yield sse({**base, "choices": [_choice(i, o.new_text, self.output_logprobs(lps, text_pos[i]),
                                                       o.finish_reason if o.finished else None)]})
                text_pos[i] += len(o.new_text)
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage(streams, body.n, completion_tokens)})
        yield DONE
