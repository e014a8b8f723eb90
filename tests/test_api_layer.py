"""The OpenAI API layer over a scripted engine client: no model runs, so each response shape and error path is
checked against exactly the outputs the client gave (loom/engine/client.py is the whole seam)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.testclient import TestClient

from loom.engine.client import EngineOverloaded, EngineStats, RequestFailed
from loom.engine.outputs import RequestMetrics, RequestOutput
from loom.sampling import SamplingParams
from loom.server.app import create_app


@dataclass
class ScriptedStream:
    request_id: str
    prompt_token_ids: list[int]
    script: list[RequestOutput | Exception]

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item


@dataclass
class ScriptedClient:
    """An EngineClient whose every request gets the same pieces of text, optionally failing after them."""

    tokenizer: object
    pieces: list[str]
    fail_after: bool = False
    overloaded: bool = False
    max_model_len: int = 512
    vocab_size: int = 320
    is_healthy: bool = True
    added: list[SamplingParams] = field(default_factory=list)
    stopped: bool = False

    async def add(self, prompt, params, request_id=None, priority=0) -> ScriptedStream:
        if self.overloaded:
            raise EngineOverloaded("2 requests are already waiting (limit 2)")
        self.added.append(params)
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        script: list[RequestOutput | Exception] = []
        text = ""
        for k, piece in enumerate(self.pieces):
            text += piece
            last = k == len(self.pieces) - 1 and not self.fail_after
            script.append(RequestOutput(request_id, None, ids, text, list(range(k + 1)), piece, [k], last,
                                        "length" if last else None, RequestMetrics(0.0, 0.0, 0.0, 1.0 if last else None)))
        if self.fail_after:
            script.append(RequestFailed("internal error while running this request"))
        return ScriptedStream(request_id, ids, script)

    def abort(self, request_id: str) -> None:
        pass

    def health(self) -> dict:
        return {"scripted": True}

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 10, 0, 0, 0, 0)

    def metrics_text(self) -> bytes:
        return b"loom_requests_running 0.0\n"

    def stop(self) -> None:
        self.stopped = True


def _events(response) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.text.splitlines() if line.startswith("data: ")]


def test_completions_whole_and_streamed_are_the_clients_outputs(tiny_llama):
    client = ScriptedClient(tiny_llama.tokenizer, ["Hel", "lo", " there"])
    with TestClient(create_app(client, "scripted")) as http:
        whole = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).json()
        assert whole["choices"][0]["text"] == "Hello there" and whole["choices"][0]["finish_reason"] == "length"
        assert whole["usage"] == {"prompt_tokens": len(tiny_llama.tokenizer.encode("Hi")), "completion_tokens": 3,
                                  "total_tokens": len(tiny_llama.tokenizer.encode("Hi")) + 3}
        events = _events(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}))
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["Hel", "lo", " there"] and events[-1] == "[DONE]"
        assert client.added[0].max_tokens == 3
    assert client.stopped  # the app's shutdown stops its engine client


def test_a_failure_after_the_header_is_an_error_event_then_done(tiny_llama):
    client = ScriptedClient(tiny_llama.tokenizer, ["a", "b"], fail_after=True)
    with TestClient(create_app(client, "scripted")) as http:
        events = _events(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "stream": True}))
        assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
        assert events[-2]["error"]["type"] == "internal_error" and events[-1] == "[DONE]"
        whole = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "internal_error"


def test_overload_is_a_503_with_retry_after(tiny_llama):
    client = ScriptedClient(tiny_llama.tokenizer, ["a"], overloaded=True)
    with TestClient(create_app(client, "scripted")) as http:
        response = http.post("/v1/completions", json={"prompt": "Hi"})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
        assert http.get("/metrics").text == "loom_requests_running 0.0\n"
        assert http.get("/health").json() == {"status": "ok", "scripted": True}
