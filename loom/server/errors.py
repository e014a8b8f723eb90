"""OpenAI-style errors: the body every 4xx / 5xx carries, the engine's failures mapped to statuses, the app's
exception handlers, and the request body size limit."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.engine.client import EngineDead, EngineOverloaded, RequestFailed, RequestTimedOut

log = logging.getLogger("loom.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (
            status, message, type_, param, code, headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def engine_error(e: Exception) -> APIError | None:
    """The HTTP error for an exception the engine client raised, or None if it is not the engine's."""
    if isinstance(e, RequestFailed):  # the traceback is in the server log, never sent to the client
        return APIError(500, "internal error while running this request", type_="internal_error")
    if isinstance(e, RequestTimedOut):
        return APIError(504, str(e), type_="timeout", code="request_timeout")
    if isinstance(e, EngineDead):
        return APIError(503, str(e), type_="engine_unavailable", code="engine_dead")
    if isinstance(e, EngineOverloaded):
        return APIError(503, str(e), type_="server_overloaded", code="overloaded", headers={"Retry-After": "1"})
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return None


def _validation_message(error: dict) -> str:
    """One pydantic error as "field.path: message", without pydantic's "Value error, " before our own messages."""
    where = ".".join(str(x) for x in error.get("loc", ()) if x != "body")
    message = str(error.get("msg", "")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(e)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = "; ".join(_validation_message(err) for err in errors[:5])
    return error_response(APIError(400, message or "invalid request", param=".".join(loc) or None))


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(e.status_code, str(e.detail), type_="invalid_request_error"))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("internal error on %s", request.url.path)
    return error_response(APIError(500, "internal server error", type_="internal_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app raises leaves as an OpenAI error body."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


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
