"""OpenAI-compatible HTTP API over the AsyncEngine (FastAPI): completions, chat, models, tokenize, health, metrics.

Bad input is a 4xx with OpenAI's error body for that request alone; overload is a 503 with Retry-After; a
client that goes away has its request aborted in the engine, so its slot and blocks return at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineOverloaded,
    RequestFailed,
    RequestStream,
    RequestTimedOut,
)
from loom.engine.engine import RequestOutput
from loom.engine.request import TokenLogprob
from loom.server.metrics import ServerMetrics
from loom.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from loom.server.tools import new_call_id, tool_calls_in_reply
from loom.tokenizer import Tokenizer

log = logging.getLogger("loom.server")

# Characters that JSON leaves raw (ensure_ascii=False) but that str.splitlines, and so httpx's iter_lines, takes for
# line breaks: a streamed event whose text held one reached such clients in pieces. Escaped, each event stays one line.
UNICODE_LINE_BREAK_ESCAPES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (
            status, message, type_, param, code, headers)


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _validation_message(error: dict) -> str:
    """One pydantic error as "field.path: message", without pydantic's "Value error, " before our own messages."""
    where = ".".join(str(x) for x in error.get("loc", ()) if x != "body")
    message = str(error.get("msg", "")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def engine_error(e: Exception) -> APIError | None:
    """The HTTP error for an exception a request's stream raised, or None if it is not the engine's."""
    if isinstance(e, RequestFailed):  # the traceback is in the server log, never sent to the client
        return APIError(500, "internal error while running this request", type_="internal_error")
    if isinstance(e, RequestTimedOut):
        return APIError(504, str(e), type_="timeout", code="request_timeout")
    if isinstance(e, EngineDead):
        return APIError(503, str(e), type_="engine_unavailable", code="engine_dead")
    return None


async def sse_with_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream's 200 header is out, an engine error becomes a final `data: {"error": ...}` event."""
    try:
        async for event in events:
            yield event
    except (RequestFailed, RequestTimedOut, EngineDead) as e:
        err = engine_error(e)
        payload = {"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}}
        yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"


class BodySizeLimit:
    """Pure ASGI middleware: refuse request bodies over `max_bytes` (declared or streamed) with a 413."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(too_big)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, too_big.message, code="request_too_large")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except APIError as e:
            await error_response(e)(scope, receive, send)


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               open_metrics: bool = False, trust_request_chat_template: bool = False) -> FastAPI:
    tokenizer: Tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len
    metrics = ServerMetrics(engine)
    engine.engine.step_observers.append(metrics.observe_step)
    engine.on_abort = metrics.finish

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="Loom", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)

    # --- errors -------------------------------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = "; ".join(_validation_message(err) for err in errors[:5])
        return error_response(APIError(400, message or "invalid request", param=".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), type_="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, "internal server error", type_="internal_error"))

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "invalid API key", type_="authentication_error", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(400, f"model {name!r} does not exist; this server serves {model_name!r}", param="model",
                           code="model_not_found")

    def render_chat(body: TokenizeRequest | ChatCompletionRequest, tools: list[dict] | None = None) -> str:
        """A request's messages through the chat template with its options; its own template only where the server
        trusts them (a template is code, and a costly one, pure Python under the GIL, would hold the whole server)."""
        if body.chat_template is not None and not trust_request_chat_template:
            raise ValueError("chat_template: this server does not take chat templates from requests (start it with "
                             "--trust-request-chat-template)")
        return tokenizer.apply_chat_template([m.as_template_dict() for m in body.messages],
                                             add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message, tools=tools,
                                             chat_template=body.chat_template,
                                             template_kwargs=body.chat_template_kwargs)

    async def add_streams(prompts: list[str | list[int]], n: int, make_params, base_id: str,
                          priority: int) -> list[RequestStream]:
        """Queue n samples of every prompt; on any error (or the client gone meanwhile), nothing stays queued."""
        streams: list[RequestStream] = []
        try:
            for pi, prompt in enumerate(prompts):
                for i in range(n):
                    streams.append(await engine.add(prompt, make_params(i), f"{base_id}-{pi}-{i}", priority))
        except BaseException as e:
            for s in streams:
                engine.abort(s.request_id)
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from e
            if isinstance(e, EngineOverloaded):
                raise APIError(503, str(e), type_="server_overloaded", code="overloaded",
                               headers={"Retry-After": "1"}) from e
            if isinstance(e, EngineDead):
                raise engine_error(e) from e
            raise
        return streams

    def log_finish(o: RequestOutput) -> None:
        m = o.metrics
        ttft = f"{1000 * m.ttft:.1f}ms" if m.ttft is not None else "-"
        total = f"{1000 * (m.finish_time - m.arrival_time):.1f}ms" if m.finish_time else "-"
        log.info("request %s: prompt_tokens=%d output_tokens=%d ttft=%s total=%s finish=%s", o.request_id,
                 len(o.prompt_token_ids), len(o.token_ids), ttft, total, o.finish_reason)

    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave several requests' outputs as they arrive, tagged with the choice index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream.outputs():
                    await queue.put((index, output))
                await queue.put((index, None))
            except Exception as e:
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    if item.finished:
                        log_finish(item)
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect_unless_disconnected(raw: Request, streams: list[RequestStream]) -> dict[int, RequestOutput]:
        """Wait for every stream's final output; if the client goes away, abort them all."""
        finals: dict[int, RequestOutput] = {}

        async def collect() -> None:
            async for index, output in merged(streams):
                if output.finished:
                    finals[index] = output

        task = asyncio.create_task(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected")
        try:
            task.result()
        except (RequestFailed, RequestTimedOut, EngineDead) as e:
            raise engine_error(e) from e
        return finals

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(token_ids: list[int], lps: list[TokenLogprob | None], offset: int) -> dict:
        """OpenAI's legacy logprobs object; an echoed prompt's first token has no logprob (None)."""
        tokens = [token_text(token_id) for token_id in token_ids]
        tops: list[dict[str, float] | None] = []
        for lp in lps:
            top: dict[str, float] | None = None
            if lp is not None:
                top = {}
                for token_id, value in lp.top:  # best first; two ids may share a text: keep the better one
                    top.setdefault(token_text(token_id), value)
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

    def joined_logprobs(parts: list[dict]) -> dict:
        return {key: [v for part in parts for v in part[key]] for key in parts[0]}

    def chat_logprobs(lps: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in lps]}

    def usage(streams: list[RequestStream], n: int, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(s.prompt_token_ids) for s in streams[::n])
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False).translate(UNICODE_LINE_BREAK_ESCAPES)}\n\n"

    # --- routes -------------------------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            raise APIError(503, "engine is not running", type_="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[] if open_metrics else [Depends(check_auth)])
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "loom", "max_model_len": max_model_len}]}

    # /tokenize and /detokenize are plain functions: FastAPI runs them on its worker threads, off the event loop.
    @app.post("/tokenize", dependencies=[Depends(check_auth)])
    def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        try:
            if body.messages is not None:
                text = render_chat(body)
                tokens = tokenizer.encode(text, add_special_tokens=False)
            else:
                tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}

    @app.post("/detokenize", dependencies=[Depends(check_auth)])
    def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = engine.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
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
        n = body.n
        streams = await add_streams(
            prompts, n, lambda i: body.sampling_params(max_tokens, body.logprobs, prompt_logprobs, seed_offset=i), rid,
            body.priority)
        created = int(time.time())
        echo_texts = [
            (p if isinstance(p, str) else tokenizer.decode(p)) if body.echo else "" for p in prompts for _ in range(n)
        ]

        def choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

        def output_logprobs(lps: list[TokenLogprob], offset: int) -> dict | None:
            if body.logprobs is None:
                return None
            return completion_logprobs([lp.token_id for lp in lps], lps, offset)

        def echo_logprobs(o: RequestOutput) -> dict | None:
            """The echoed prompt's tokens scored, as OpenAI's echo with logprobs gives them."""
            if o.prompt_logprobs is None:
                return None
            return completion_logprobs(o.prompt_token_ids, o.prompt_logprobs, 0)

        if not body.stream:
            finals = await collect_unless_disconnected(raw, streams)
            choices = []
            for i in range(len(streams)):
                o = finals[i]
                text, lps, reason = ("", [], "length") if echo_only else (o.text, o.logprobs, o.finish_reason)
                logprobs = output_logprobs(lps, len(echo_texts[i]))
                echoed = echo_logprobs(o)
                if echoed is not None and logprobs is not None:
                    logprobs = joined_logprobs([echoed, logprobs])
                choices.append(choice(i, echo_texts[i] + text, logprobs, reason))
            completion_tokens = 0 if echo_only else sum(len(o.token_ids) for o in finals.values())
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": choices, "usage": usage(streams, n, completion_tokens)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            sent_lps = [0] * len(streams)
            text_pos = [len(t) for t in echo_texts]
            completion_tokens = 0
            base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
            # An echo with logprobs waits for the prompt's scores, which come with the choice's first output.
            echo_waits = [prompt_logprobs is not None] * len(streams)
            if body.echo and prompt_logprobs is None:
                for i, t in enumerate(echo_texts):
                    yield sse({**base, "choices": [choice(i, t, None, None)]})
            async for i, o in merged(streams):
                if echo_waits[i]:
                    echo_waits[i] = False
                    yield sse({**base, "choices": [choice(i, echo_texts[i], echo_logprobs(o), None)]})
                if echo_only:
                    if o.finished:
                        yield sse({**base, "choices": [choice(i, "", output_logprobs([], text_pos[i]), "length")]})
                    continue
                completion_tokens += len(o.new_token_ids)
                lps: list[TokenLogprob] = []
                if body.logprobs is not None:
                    lps = o.logprobs[sent_lps[i]:]
                    sent_lps[i] = len(o.logprobs)
                if o.new_text or lps or o.finished:
                    yield sse({**base, "choices": [choice(i, o.new_text, output_logprobs(lps, text_pos[i]),
                                                          o.finish_reason if o.finished else None)]})
                    text_pos[i] += len(o.new_text)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(streams, n, completion_tokens)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse_with_errors(events()), media_type="text/event-stream")

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = body.top_logprobs
        logprobs = (top or 0) if body.logprobs else None

        def prompt_ids_and_max_tokens() -> tuple[list[int], int]:
            """The rendered, tokenized prompt (on a worker thread: a long chat takes milliseconds) and max_tokens."""
            if top is not None and not body.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            ids = tokenizer.encode(render_chat(body, body.tool_dicts()), add_special_tokens=False)
            most = max(1, max_model_len - len(ids)) if max_tokens is None else max_tokens  # OpenAI's default: all
            body.sampling_params(most, logprobs)
            return ids, most

        try:
            prompt_ids, max_tokens = await asyncio.to_thread(prompt_ids_and_max_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        n = body.n
        streams = await add_streams([prompt_ids], n,
                                    lambda i: body.sampling_params(max_tokens, logprobs, seed_offset=i), rid,
                                    body.priority)
        created = int(time.time())

        tool_choice = body.tool_choice_value() if body.forces_tool_call else None

        def reply(o: RequestOutput) -> tuple[dict, str | None]:
            """The assistant's message and finish reason: a forced tool call's reply read back into tool_calls."""
            calls = None if tool_choice is None else tool_calls_in_reply(o.text, tool_choice)
            if calls is None:
                return {"role": "assistant", "content": o.text}, o.finish_reason
            # As vLLM: "tool_calls" ends a required call's reply, a named call's ends as its output did (OpenAI's way).
            reason = "tool_calls" if tool_choice == "required" and o.finish_reason == "stop" else o.finish_reason
            return {"role": "assistant", "content": None, "tool_calls": calls}, reason

        if not body.stream:
            finals = await collect_unless_disconnected(raw, streams)
            choices = []
            for i in range(len(streams)):
                message, reason = reply(finals[i])
                choices.append({"index": i, "message": message, "finish_reason": reason,
                                "logprobs": chat_logprobs(finals[i].logprobs) if logprobs is not None else None})
            completion_tokens = sum(len(o.token_ids) for o in finals.values())
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": choices, "usage": usage(streams, n, completion_tokens)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
            for i in range(len(streams)):
                yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            sent_lps = [0] * len(streams)
            calls_begun: set[int] = set()  # choices whose named call has sent its id and name
            completion_tokens = 0
            async for i, o in merged(streams):
                completion_tokens += len(o.new_token_ids)
                lps = None
                if logprobs is not None:
                    lps = chat_logprobs(o.logprobs[sent_lps[i]:])
                    sent_lps[i] = len(o.logprobs)
                if not (o.new_text or o.finished or (lps and lps["content"])):
                    continue
                reason = o.finish_reason if o.finished else None
                delta = {"content": o.new_text} if o.new_text else {}
                if isinstance(tool_choice, dict) and o.new_text:  # a named call streams its arguments as they come
                    call = {"index": 0, "function": {"arguments": o.new_text}}
                    if i not in calls_begun:
                        calls_begun.add(i)
                        call.update(id=new_call_id(), type="function")
                        call["function"]["name"] = tool_choice["function"]["name"]
                    delta = {"tool_calls": [call]}
                elif tool_choice == "required":  # a list of calls is read once it is whole
                    delta = {}
                    if o.finished:
                        message, reason = reply(o)
                        if message["content"] is None:
                            delta = {"tool_calls": [{"index": k, **call} for k, call in
                                                    enumerate(message["tool_calls"])]}
                        else:
                            delta = {"content": message["content"]}
                yield sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lps,
                                                "finish_reason": reason}]})
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(streams, n, completion_tokens)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse_with_errors(events()), media_type="text/event-stream")

    return app
