"""POST /v1/chat/completions: messages through the model's chat template, forced tool calls read back into
`tool_calls`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from loom.engine.client import EngineClient, RequestStream
from loom.engine.outputs import RequestOutput
from loom.server.errors import APIError
from loom.server.protocol import ChatCompletionRequest, TokenizeRequest
from loom.server.responses import LogprobFormatter, usage
from loom.server.streaming import DONE, add_streams, collect_unless_disconnected, merged, sse, sse_with_errors
from loom.server.tools import new_call_id, tool_calls_in_reply
from loom.tokenizer import Tokenizer


class ChatRenderer:
    """A request's messages through the chat template with its options; the request's own template only where the
    server trusts them (a template is code, and a costly one, pure Python under the GIL, would hold the server)."""

    def __init__(self, tokenizer: Tokenizer, trust_request_chat_template: bool) -> None:
        self.tokenizer, self.trust_request_chat_template = tokenizer, trust_request_chat_template

    def render(self, body: TokenizeRequest | ChatCompletionRequest, tools: list[dict] | None = None) -> str:
        if body.chat_template is not None and not self.trust_request_chat_template:
            raise ValueError("chat_template: this server does not take chat templates from requests (start it with "
                             "--trust-request-chat-template)")
        return self.tokenizer.apply_chat_template([m.as_template_dict() for m in body.messages],
                                                  add_generation_prompt=body.add_generation_prompt,
                                                  continue_final_message=body.continue_final_message, tools=tools,
                                                  chat_template=body.chat_template,
                                                  template_kwargs=body.chat_template_kwargs)


class ChatServing:
    def __init__(self, client: EngineClient, model_name: str, renderer: ChatRenderer) -> None:
        self.client, self.model_name, self.renderer = client, model_name, renderer
        self.logprobs = LogprobFormatter(client.tokenizer)

    def _prompt_and_max_tokens(self, body: ChatCompletionRequest, logprobs: int | None) -> tuple[list[int], int]:
        """The rendered, tokenized prompt and max_tokens (on a worker thread: a long chat takes milliseconds)."""
        if body.top_logprobs is not None and not body.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        ids = self.client.tokenizer.encode(self.renderer.render(body, body.tool_dicts()), add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        most = max(1, self.client.max_model_len - len(ids)) if max_tokens is None else max_tokens  # OpenAI: all
        body.sampling_params(most, logprobs)
        return ids, most

    async def create(self, body: ChatCompletionRequest, raw: Request) -> dict | StreamingResponse:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            prompt_ids, max_tokens = await asyncio.to_thread(self._prompt_and_max_tokens, body, logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await add_streams(self.client, [prompt_ids], body.n,
                                    lambda i: body.sampling_params(max_tokens, logprobs, seed_offset=i), rid,
                                    body.priority)
        response = _ChatResponse(self, body, rid, logprobs)
        if not body.stream:
            return response.whole(await collect_unless_disconnected(raw, streams), streams)
        return StreamingResponse(sse_with_errors(response.events(streams)), media_type="text/event-stream")


class _ChatResponse:
    """One request's answer, whole or as events."""

    def __init__(self, serving: ChatServing, body: ChatCompletionRequest, rid: str, logprobs: int | None) -> None:
        self.serving, self.body, self.logprobs = serving, body, logprobs
        self.tool_choice = body.tool_choice_value() if body.forces_tool_call else None
        self.id, self.created = rid, int(time.time())

    def reply(self, o: RequestOutput) -> tuple[dict, str | None]:
        """The assistant's message and finish reason: a forced tool call's reply read back into tool_calls."""
        calls = None if self.tool_choice is None else tool_calls_in_reply(o.text, self.tool_choice)
        if calls is None:
            return {"role": "assistant", "content": o.text}, o.finish_reason
        # As vLLM: "tool_calls" ends a required call's reply, a named call's ends as its output did (OpenAI's way).
        reason = "tool_calls" if self.tool_choice == "required" and o.finish_reason == "stop" else o.finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, reason

    def whole(self, finals: dict[int, RequestOutput], streams: list[RequestStream]) -> dict:
        choices = []
        for i in range(len(streams)):
            message, reason = self.reply(finals[i])
            logprobs = self.serving.logprobs.chat(finals[i].logprobs) if self.logprobs is not None else None
            choices.append({"index": i, "message": message, "finish_reason": reason, "logprobs": logprobs})
        completion_tokens = sum(len(o.token_ids) for o in finals.values())
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.serving.model_name, "choices": choices,
                "usage": usage(streams, self.body.n, completion_tokens)}

    def _delta(self, i: int, o: RequestOutput, calls_begun: set[int]) -> tuple[dict, str | None]:
        """A chunk's delta: text, a named call's arguments as they come, or a required call's list once whole."""
        reason = o.finish_reason if o.finished else None
        delta = {"content": o.new_text} if o.new_text else {}
        if isinstance(self.tool_choice, dict) and o.new_text:
            call = {"index": 0, "function": {"arguments": o.new_text}}
            if i not in calls_begun:
                calls_begun.add(i)
                call.update(id=new_call_id(), type="function")
                call["function"]["name"] = self.tool_choice["function"]["name"]
            delta = {"tool_calls": [call]}
        elif self.tool_choice == "required":
            delta = {}
            if o.finished:
                message, reason = self.reply(o)
                if message["content"] is None:
                    delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}
                else:
                    delta = {"content": message["content"]}
        return delta, reason

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        base = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.serving.model_name}
        for i in range(len(streams)):
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        sent_lps = [0] * len(streams)
        calls_begun: set[int] = set()  # choices whose named call has sent its id and name
        completion_tokens = 0
        async for i, o in merged(streams):
            completion_tokens += len(o.new_token_ids)
            lps = None
            if self.logprobs is not None:
                lps = self.serving.logprobs.chat(o.logprobs[sent_lps[i]:])
                sent_lps[i] = len(o.logprobs)
            if not (o.new_text or o.finished or (lps and lps["content"])):
                continue
            delta, reason = self._delta(i, o, calls_begun)
            yield sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason}]})
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage(streams, self.body.n, completion_tokens)})
        yield DONE
