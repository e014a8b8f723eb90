"""The OpenAI-compatible HTTP API over an engine client (FastAPI): completions, chat, models, tokenizer, health,
metrics. Each route hands its request to the endpoint family's serving object (serving_*.py).

Bad input is a 4xx with OpenAI's error body for that request alone; overload is a 503 with Retry-After; a
client that goes away has its request aborted in the engine, so its slot and blocks return at once.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from loom.engine.client import EngineClient
from loom.server.errors import APIError, BodySizeLimit, install_error_handlers
from loom.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from loom.server.serving_chat import ChatRenderer, ChatServing
from loom.server.serving_completions import CompletionServing
from loom.server.serving_tokens import TokenServing


class _Access:
    """The API key and the served model's name, checked on every request that names them."""

    def __init__(self, api_key: str | None, model_name: str) -> None:
        self.api_key, self.model_name = api_key, model_name

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "invalid API key", type_="authentication_error", code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(400, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")


def create_app(client: EngineClient, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               open_metrics: bool = False, trust_request_chat_template: bool = False,
               enable_tokenizer_info_endpoint: bool = False) -> FastAPI:
    access = _Access(api_key, model_name)
    renderer = ChatRenderer(client.tokenizer, trust_request_chat_template)
    completions = CompletionServing(client, model_name)
    chat = ChatServing(client, model_name, renderer)
    tokens = TokenServing(client, renderer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(client.stop)

    app = FastAPI(title="Loom", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    install_error_handlers(app)
    keyed = [Depends(access.check_key)]

    # /health and /metrics are plain functions, on FastAPI's worker threads: a client of replicas asks Serve and
    # the replicas over the network.
    @app.get("/health")
    def health():
        if not client.is_healthy:
            raise APIError(503, "engine is not running", type_="engine_unavailable")
        return {"status": "ok", **client.health()}

    @app.get("/metrics", dependencies=[] if open_metrics else keyed)
    def metrics():
        return Response(client.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "loom", "max_model_len": client.max_model_len}]}

    @app.post("/tokenize", dependencies=keyed)
    def tokenize(body: TokenizeRequest):
        access.check_model(body.model)
        return tokens.tokenize(body)

    @app.post("/detokenize", dependencies=keyed)
    def detokenize(body: DetokenizeRequest):
        access.check_model(body.model)
        return tokens.detokenize(body)

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info", dependencies=keyed)
        def tokenizer_info():
            return tokens.tokenizer_info()

    @app.post("/v1/completions", dependencies=keyed)
    async def create_completion(body: CompletionRequest, raw: Request):
        access.check_model(body.model)
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        access.check_model(body.model)
        return await chat.create(body, raw)

    return app
