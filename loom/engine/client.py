"""The engine client: everything the OpenAI API layer may ask of an engine, wherever the engine runs.

The API layer (loom/server/) holds one EngineClient and nothing else of the engine. `AsyncEngine` implements it
in this process; a client for engine replicas elsewhere implements the same, so the API exists once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from loom.engine.outputs import RequestOutput
from loom.sampling import SamplingParams
from loom.tokenizer import Tokenizer


class EngineOverloaded(Exception):
    """The waiting queue is over its limit: try again later."""


class EngineDead(Exception):
    """The engine loop stopped on a fatal error; no request can be served."""


class RequestFailed(Exception):
    """The model step running this request raised; the request was ended (the engine itself goes on)."""


class RequestTimedOut(Exception):
    """The request ran past the server's per-request deadline and was aborted."""


@dataclass
class EngineStats:
    """A snapshot of the engine's load and caches."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    draft_tokens: int  # speculation: draft tokens checked, and those accepted
    accepted_tokens: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class RequestStream(Protocol):
    """One request's outputs as they come; leaving `outputs()` early (disconnect, cancel) aborts the request."""

    request_id: str
    prompt_token_ids: list[int]

    def outputs(self) -> AsyncIterator[RequestOutput]: ...


class EngineClient(Protocol):
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int

    @property
    def is_healthy(self) -> bool: ...

    def health(self) -> dict:
        """What GET /health reports beside its status (a client of replicas: how many are ready)."""

    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                  priority: int = 0) -> RequestStream:
        """Validate and queue a request: ValueError on bad input, EngineOverloaded, EngineDead."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def metrics_text(self) -> bytes:
        """The engine's Prometheus metrics in the text exposition format."""

    def stop(self) -> None:
        """End every request in flight and release the engine (the server's shutdown)."""
