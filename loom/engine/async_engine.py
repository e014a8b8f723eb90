"""AsyncEngine: the step loop on its own thread, per-request asyncio streams for the HTTP server.

The asyncio event loop never runs a model step, and does not make requests either (`add` tokenizes a prompt and
compiles a grammar on a worker thread): it puts commands (add, abort) on a queue and awaits outputs. The engine
thread drains the queue between steps, runs `step()` while there is work and sleeps on an event (no busy spin) when
there is none. An abort takes effect before the next step; a step's outputs reach each event loop in one hand-off.

Given a factory instead of a built engine, the engine thread builds the model and warms it up itself, so that every
OpenMP parallel region of the process starts from that one thread. A second thread that runs parallel regions gets
a second OpenMP team, and with more OpenMP threads than cores libgomp stops spinning at barriers and sleeps: a
decode step ran about twice as slow on the engine thread when the main thread had built the model.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from loom.engine.client import EngineDead, EngineOverloaded, EngineStats, RequestFailed, RequestTimedOut
from loom.engine.engine import LLMEngine, StepFailed
from loom.engine.metrics import EngineMetrics
from loom.engine.outputs import RequestOutput
from loom.engine.request import Request
from loom.sampling import SamplingParams

log = logging.getLogger("loom.engine")

ENGINE_THREAD_NAME = "loom-engine"


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (top, /proc/PID/task/TID/comm), where Linux allows it."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


@dataclass
class _Add:
    request: Request
    stream: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Route:
    """Where a request's outputs go: its stream, on the event loop that awaits it."""

    stream: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


class RequestStream:
    """One request's outputs as they come; leaving `outputs()` early (disconnect, cancel) aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str, prompt_token_ids: list[int]) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self.engine.abort(self.request_id)


class AsyncEngine:
    """The EngineClient of an engine in this process (loom/engine/client.py): `add()` queues a request; its
    RequestStream yields outputs as steps produce them."""

    engine: LLMEngine  # set on the engine thread, before the constructor returns

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_waiting: int | None = None,
                 request_timeout: float | None = None) -> None:
        """`engine`: a built LLMEngine, or a factory that the engine thread calls (then warms the model up) before
        this returns; an exception the factory raises is raised here."""
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._routes: dict[str, _Route] = {}  # touched only by the engine thread
        self._deadlines: dict[str, float] = {}  # request id -> monotonic deadline; engine thread only
        self._handoff: dict[asyncio.AbstractEventLoop, list] = {}  # this step's deliveries; engine thread only
        self._stopping = False
        self.error: BaseException | None = None
        built = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(engine, built, failure), name=ENGINE_THREAD_NAME,
                                        daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.metrics = EngineMetrics(self.stats)
        self.engine.step_observers.append(self.metrics.observe_step)  # runs on the engine thread

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Abort whatever is still in flight and end the engine thread."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def health(self) -> dict:
        return {}  # one engine in this process: its status says it all

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    def stats(self) -> EngineStats:
        """Read from another thread: each figure is whole, though two may be a step apart."""
        engine = self.engine
        return EngineStats(running=len(engine.scheduler.running), waiting=self.num_waiting,
                           kv_blocks_used=engine.pool.num_used_blocks, kv_blocks_total=engine.pool.num_usable_blocks,
                           prefix_cache_queries=engine.scheduler.prefix_cache_queries,
                           prefix_cache_hits=engine.scheduler.prefix_cache_hits,
                           draft_tokens=engine.num_draft_tokens, accepted_tokens=engine.num_accepted_tokens)

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    # --- requests -----------------------------------------------------------------------------------------------

    async def add(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> RequestStream:
        """Validate (ValueError on bad input, EngineOverloaded, EngineDead) and queue; stream outputs later.

        The request is made on a worker thread: tokenizing a long prompt and compiling its grammar would hold the
        event loop, and with it every other request's stream (a 3.5K-token prompt 5 ms, a 60-field JSON schema 8 ms,
        the first grammar 0.24 s). Nothing made there runs a torch parallel region (tests/test_openmp_teams.py)."""
        self._check_admission()
        request = await asyncio.to_thread(self.engine.create_request, prompt, params, request_id, priority=priority)
        self._check_admission()  # again: others may have been queued, or the engine died, meanwhile
        stream = RequestStream(self, request.request_id, request.prompt_token_ids)
        self._send(_Add(request, stream.queue, asyncio.get_running_loop()))
        return stream

    def _check_admission(self) -> None:
        if not self.is_healthy:
            raise EngineDead("the engine is not running")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are already waiting (limit {self.max_waiting})")

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # --- engine thread ------------------------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Queue an output for its stream; `_hand_off` passes everything queued to the event loops."""
        route = self._routes.get(request_id)
        if route is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._routes[request_id]
            self._deadlines.pop(request_id, None)
        self._handoff.setdefault(route.loop, []).append((route.stream, item))

    def _hand_off(self) -> None:
        """One call per event loop for everything delivered since the last hand-off (a whole step's outputs)."""
        for loop, items in self._handoff.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody awaits these streams any more
                pass
        self._handoff = {}

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                try:
                    self.engine.submit(command.request)
                except ValueError as e:
                    self._handoff.setdefault(command.loop, []).append((command.stream, e))
                    continue
                self._routes[command.request.request_id] = _Route(command.stream, command.loop)
                if self.request_timeout is not None:
                    self._deadlines[command.request.request_id] = command.request.arrival_time + self.request_timeout
            else:
                self._abort(command.request_id)

    def _abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request; its stream gets its final output, or `error` instead when one is given."""
        output = self.engine.abort(request_id)
        if output is not None:
            self._ended_early(output, error)

    def _ended_early(self, output: RequestOutput, error: BaseException | None = None) -> None:
        """Report a request the engine ended outside a normal step: to the metrics, then to its stream."""
        self.metrics.finish(output)
        self._deliver(output.request_id, error if error is not None else output)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, deadline in self._deadlines.items() if deadline <= now]:
            self._abort(request_id, RequestTimedOut(f"request exceeded the server's {self.request_timeout:g} s limit"))
            self._deadlines.pop(request_id, None)

    def _step(self) -> None:
        """One engine step; a failed forward fails only the requests it carried."""
        try:
            outputs = self.engine.step()
        except StepFailed as e:
            log.error("model step failed; ending its %d request(s) with an error", len(e.outputs),
                      exc_info=e.__cause__)
            for output in e.outputs:
                self._ended_early(output, RequestFailed("internal error while running this request"))
            return
        for output in outputs:
            self._deliver(output.request_id, output)

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: threading.Event,
             failure: list[BaseException]) -> None:
        _name_os_thread(ENGINE_THREAD_NAME)  # before any kernel runs: its OpenMP workers inherit the name
        try:
            if isinstance(engine, LLMEngine):
                self.engine = engine
            else:
                self.engine = engine()
                self.engine.warm_up()
        except BaseException as e:
            failure.append(e)
            return
        finally:
            built.set()
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._drain_commands()
                self._expire_deadlines()
                if not self.engine.has_unfinished_requests():
                    self._hand_off()
                    self._wakeup.wait()
                    continue
                self._step()
                self._hand_off()
        except BaseException as e:  # a fatal engine failure: fail everyone, report unhealthy
            log.exception("engine loop died")
            self.error = e
            for request_id in list(self._routes):
                self._deliver(request_id, EngineDead(f"engine failure: {type(e).__name__}"))
            self._hand_off()
            return
        for request_id in list(self.engine.requests):  # shutting down: end every stream cleanly
            self._abort(request_id)
        self._hand_off()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    """On the event loop: put a hand-off's outputs into their streams."""
    for stream, item in items:
        stream.put_nowait(item)
