"""Requests' output streams as the API answers from them: queued together, merged as they come, collected unless
the client goes away, and written as server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from fastapi import Request

from loom.engine.client import EngineClient, EngineDead, RequestFailed, RequestStream, RequestTimedOut
from loom.engine.outputs import RequestOutput
from loom.sampling import SamplingParams
from loom.server.errors import APIError, engine_error

log = logging.getLogger("loom.server")

# Characters that JSON leaves raw (ensure_ascii=False) but that str.splitlines, and so httpx's iter_lines, takes for
# line breaks: a streamed event whose text held one reached such clients in pieces. Escaped, each event stays one line.
UNICODE_LINE_BREAK_ESCAPES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event holding `payload` as JSON on a single line."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(UNICODE_LINE_BREAK_ESCAPES)}\n\n"


async def sse_with_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream's 200 header is out, an engine error becomes a final `data: {"error": ...}` event."""
    try:
        async for event in events:
            yield event
    except (RequestFailed, RequestTimedOut, EngineDead) as e:
        yield sse(engine_error(e).body())
        yield DONE


async def add_streams(client: EngineClient, prompts: list[str | list[int]], n: int,
                      make_params: Callable[[int], SamplingParams], base_id: str,
                      priority: int) -> list[RequestStream]:
    """Queue n samples of every prompt; on any error (or the client gone meanwhile), nothing stays queued."""
    streams: list[RequestStream] = []
    try:
        for pi, prompt in enumerate(prompts):
            for i in range(n):
                streams.append(await client.add(prompt, make_params(i), f"{base_id}-{pi}-{i}", priority))
    except BaseException as e:
        for s in streams:
            client.abort(s.request_id)
        error = engine_error(e) if isinstance(e, Exception) else None
        if error is not None:
            raise error from e
        raise
    return streams


def _log_finish(o: RequestOutput) -> None:
    m = o.metrics
    ttft = f"{1000 * m.ttft:.1f}ms" if m.ttft is not None else "-"
    total = f"{1000 * (m.finish_time - m.arrival_time):.1f}ms" if m.finish_time else "-"
    log.info("request %s: prompt_tokens=%d output_tokens=%d ttft=%s total=%s finish=%s", o.request_id,
             len(o.prompt_token_ids), len(o.token_ids), ttft, total, o.finish_reason)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they arrive, tagged with the choice index."""
    if len(streams) == 1:  # one choice: its own stream, without a queue and a task between
        async with aclosing(streams[0].outputs()) as outputs:  # closed (and aborted) if the reader stops early
            async for output in outputs:
                if output.finished:
                    _log_finish(output)
                yield 0, output
        return
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
                    _log_finish(item)
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
