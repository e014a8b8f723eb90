"""LLMEngine: add_request / step / abort over the scheduler and the runner, for callers that drive the loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from loom.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from loom.engine.host_memory import keep_large_allocations
from loom.engine.input import RequestLimits, make_request
from loom.engine.kv_cache import BlockPool, KVCacheSpec
from loom.engine.kv_manager import KVCacheManager
from loom.engine.ngram_proposer import NgramProposer
from loom.engine.outputs import RequestMetrics, RequestOutput
from loom.engine.request import Request
from loom.engine.runner import ModelRunner, StepResult
from loom.engine.scheduler import ContinuousScheduler, Scheduler, SchedulerOutput, StaticScheduler
from loom.model.attention import make_attention
from loom.model.layer_ops import make_layer_ops
from loom.model.linear import make_matmul
from loom.model.loader import LoadedModel, load_model
from loom.model.sampler import make_sampler
from loom.sampling import SamplingParams, TokenLogprob
from loom.structured_output import GrammarCompiler
from loom.tokenizer import IncrementalDetokenizer


@dataclass
class _Stream:
    """Per-request output bookkeeping the scheduler does not need."""

    detokenizer: IncrementalDetokenizer
    max_stop_len: int
    sent_text_len: int = 0
    sent_token_len: int = 0


class StepFailed(Exception):
    """The model forward of one step raised: its requests are finished with reason 'error', the engine goes on.

    `outputs` are those requests' final outputs; the original exception is the `__cause__`.
    """

    def __init__(self, outputs: list[RequestOutput]) -> None:
        super().__init__(f"a model step failed; {len(outputs)} request(s) ended with an error")
        self.outputs = outputs


StepObserver = Callable[[SchedulerOutput, StepResult | None, list[RequestOutput], float], None]


class LLMEngine:
    """One model, one KV pool, one scheduler. `step()` runs exactly one forward over the packed row."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.loaded = loaded or load_model(self.config.model)
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.config
        self.model_config = mcfg
        self.max_model_len = min(self.config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        cache = self.config.cache
        kv_spec = KVCacheSpec(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, cache.block_size, self.config.dtype,
                              quantized=cache.kv_cache_dtype == "int8", groups=mcfg.kv_cache_groups)
        num_blocks = cache.num_kv_blocks or kv_spec.num_blocks_for_memory(cache.kv_cache_memory)
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, cache.block_size, kv_spec.groups)
        # An engine that read the weights itself is their only user: the model may consume them as it builds, so
        # the originals and their packed copies are never all in memory at once.
        model = self.loaded.build(self.config.dtype, make_matmul(self.config.matmul_backend, self.config.quantization,
                                                              self.config.dtype),
                                  make_layer_ops(self.config.layer_ops), consume=loaded is None)
        self.runner = ModelRunner(model, kv_spec, num_blocks, make_attention(self.config.attention_backend),
                                  make_sampler())
        self.scheduler = self._make_scheduler(self.config.scheduler)
        self.grammars = GrammarCompiler(self.tokenizer, mcfg.vocab_size)
        self.request_limits = RequestLimits(
            mcfg.vocab_size, self.max_model_len,
            self.kv.max_request_tokens(self.config.scheduler.max_num_batched_tokens))
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, _Stream] = {}
        self.step_observers: list[StepObserver] = []  # called after every step (metrics, traces, demos)
        self.set_speculative(self.config.speculative)  # the proposer
        self.num_draft_tokens = 0  # speculation: draft tokens checked, and those accepted
        self.num_accepted_tokens = 0
        keep_large_allocations()  # a step's big buffers (logits of many rows) reused, not faulted in (host_memory.py)

    def describe(self) -> str:
        """What this engine chose to run with, for a server's start-up log."""
        spec, blocks = self.runner.kv_spec, self.runner.num_blocks
        layers = self.runner.model.layer_linears()
        return (f"dtype {str(self.config.dtype).removeprefix('torch.')}, {self.config.num_threads or torch.get_num_threads()} "
                f"threads; layer matmuls {type(layers[0]).__name__ if layers else 'none'}, attention "
                f"{type(self.runner.attention).__name__}; KV cache {blocks} blocks of {spec.block_size} tokens "
                f"({blocks * spec.bytes_per_block / (1 << 20):.0f} MiB, "
                f"{blocks * spec.block_size // len(spec.groups)} tokens of every layer"
                f"{f', {len(spec.groups)} groups of {spec.layers_per_block} layers' if len(spec.groups) > 1 else ''})")

    @contextmanager
    def observing(self, observer: StepObserver) -> Iterator[None]:
        """Call `observer` after every step inside the with-block."""
        self.step_observers.append(observer)
        try:
            yield
        finally:
            self.step_observers.remove(observer)

    def _make_scheduler(self, config: SchedulerConfig) -> Scheduler:
        if config.policy == "static":
            return StaticScheduler(config, self.kv)
        return ContinuousScheduler(config, self.kv, self.config.cache.enable_prefix_caching,
                                   self.model_config.attention_keys_per_token)

    def set_scheduler(self, config: SchedulerConfig) -> None:
        """Swap the scheduling policy (e.g. static vs continuous on the same weights and cache); only when idle."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot change the scheduler while requests are in flight")
        self.config.scheduler = config
        self.scheduler = self._make_scheduler(config)

    def set_speculative(self, config: SpeculativeConfig | None) -> None:
        """Swap the speculation settings (None: one token a step), e.g. several on the same engine in a benchmark;
        only when idle. Drafts are proposed under the continuous policy alone."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot change speculation while requests are in flight")
        self.config.speculative = config
        self.proposer = NgramProposer(config) if config is not None else None
        self.latest_draft_limit: int | None = None  # where the latest check left its request's limit

    # --- requests ---------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and queue a request; raises ValueError (for this request only) on bad input."""
        request = self.create_request(prompt, params, request_id, arrival_time, priority)
        self.submit(request)
        return request.request_id

    def create_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Tokenize and validate without touching engine state, so another thread may do it while steps run."""
        return make_request(prompt, params, tokenizer=self.tokenizer, limits=self.request_limits,
                            grammars=self.grammars, request_id=request_id, arrival_time=arrival_time,
                            priority=priority)

    def submit(self, request: Request) -> None:
        """Queue a request made by `create_request`."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params = request.params
        self.requests[request.request_id] = request
        self._streams[request.request_id] = _Stream(
            detokenizer=self.tokenizer.detokenizer(request.prompt_token_ids, params.skip_special_tokens),
            max_stop_len=max((len(s) for s in params.stop), default=0),
        )
        self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its slot and blocks are freed; returns its final output (finish_reason 'abort')."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        return self._end_now(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the loop -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward, append sampled tokens, retire finished requests."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        try:
            result = None if out.is_empty else self.runner.execute(out)
        except Exception as e:
            # Nothing of the failed step is appended; its requests end with their blocks and slots freed.
            raise StepFailed([self._end_now(s.request, "error") for s in out.scheduled]) from e
        outputs: list[RequestOutput] = []
        if result is not None:
            now = time.monotonic()
            for index, (sched, tokens, logprobs) in enumerate(zip(out.scheduled, result.tokens, result.logprobs)):
                request = sched.request
                # Draft tokens' K/V count once they are accepted: each one before the token after it.
                self.scheduler.mark_computed(request, len(sched.token_ids) - len(sched.draft_token_ids))
                request.prompt_logprobs += result.prompt_logprobs.get(index, [])
                if not tokens:
                    continue
                if request.first_token_time is None:
                    request.first_token_time = now
                self.num_draft_tokens += len(sched.draft_token_ids)
                self.num_accepted_tokens += len(tokens) - 1
                if sched.draft_token_ids:
                    request.draft_limit = self.config.speculative.next_draft_limit(
                        request.draft_limit, len(sched.draft_token_ids), len(tokens) - 1)
                    self.latest_draft_limit = request.draft_limit
                for k, (token, logprob) in enumerate(zip(tokens, logprobs)):
                    if k:
                        self.scheduler.mark_computed(request, 1)
                    self._append_token(request, token, logprob)
                    if request.is_finished:
                        break
                outputs.append(self._output(request, final=request.is_finished))
            if self.proposer is not None and isinstance(self.scheduler, ContinuousScheduler):
                self._propose(out)
        seconds = time.perf_counter() - started
        for observer in self.step_observers:
            observer(out, result, outputs, seconds)
        for o in outputs:
            if o.finished:
                self._forget(o.request_id)
        return outputs

    def warm_up(self) -> None:
        """Run one short request (a prefill and a decode) and forget it: the calling thread starts the kernels'
        thread team and touches the step's buffers before the first real request. The prompt fills no KV block, so
        the prefix cache stays empty; the speculation counters are reset."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up runs only on an idle engine")
        token = min(self.tokenizer.eos_token_ids, default=0)
        self.add_request([token], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                         request_id="loom-warm-up")
        self.run_to_completion()
        self.num_draft_tokens = self.num_accepted_tokens = 0

    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until no request is left; the final output of every request that finished meanwhile."""
        finished: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    finished[output.request_id] = output
        return finished

    def _propose(self, out: SchedulerOutput) -> None:
        """Draft tokens for each request that now awaits its next token, as far as its limits leave room for them
        and the one token of its own after them, and as many as the running requests' number allows; none for
        requests whose logits change before sampling; and under a heuristic schedule, no more than the request's
        own limit, which its checks move (SpeculativeConfig.first_draft_limit and next_draft_limit)."""
        spec = self.config.speculative
        most = spec.drafts_for(len(self.scheduler.running))
        for sched in out.scheduled:
            request = sched.request
            if request.is_finished or not request.awaits_next_token:
                continue
            if request.draft_limit is None:
                request.draft_limit = spec.first_draft_limit(self.latest_draft_limit)
            room = min(request.params.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)
            allowed = most > 0 and not request.params.adjusts_logits
            request.draft_token_ids = (self.proposer.propose(request.token_ids(0, request.num_tokens),
                                                             min(most, request.draft_limit, room - 1))
                                       if allowed else [])

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        params = request.params
        request.output_token_ids.append(token)
        if request.grammar is not None:
            request.grammar.accept(token)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        stream = self._streams[request.request_id]
        prev_len = len(request.output_text)
        request.output_text += stream.detokenizer.step(token)

        reason = None
        if request.below_min_tokens:
            pass  # too short to stop (the sampler held back EOS and stop_token_ids)
        elif token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids):
            reason = "stop"
            if not params.include_stop_str_in_output:  # as a stop string's, the stop token's text is left out
                request.output_text = request.output_text[:prev_len]
        elif params.stop:
            hit = self._find_stop(request.output_text, params.stop, prev_len)
            if hit is not None:
                start, stop = hit
                request.output_text = request.output_text[: start + len(stop) if params.include_stop_str_in_output
                                                          else start]
                reason = "stop"
        if reason is None and request.grammar is not None and request.grammar.is_complete:
            reason = "stop"  # the output is a whole sentence of its grammar
        if reason is None and (
            request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(request, reason)

    @staticmethod
    def _find_stop(text: str, stops: list[str], prev_len: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in the newly added text, with its index, if any."""
        hits = [(i, s) for s in stops if (i := text.find(s, max(0, prev_len - len(s) + 1))) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _output(self, request: Request, final: bool) -> RequestOutput:
        stream = self._streams[request.request_id]
        text = request.output_text
        # While a stop string might still be completing, hold back the text that could be its beginning.
        visible = len(text) if final or not stream.max_stop_len else max(0, len(text) - stream.max_stop_len + 1)
        visible = max(visible, stream.sent_text_len)
        new_text = text[stream.sent_text_len : visible]
        new_tokens = request.output_token_ids[stream.sent_token_len :]
        stream.sent_text_len, stream.sent_token_len = visible, request.num_output_tokens
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text[:visible],
            token_ids=list(request.output_token_ids),
            new_text=new_text,
            new_token_ids=new_tokens,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finish_time=request.finish_time,
                num_preemptions=request.num_preemptions,
            ),
            logprobs=list(request.output_logprobs),
            prompt_logprobs=None if request.params.prompt_logprobs is None else list(request.prompt_logprobs),
        )

    def _end_now(self, request: Request, reason: str) -> RequestOutput:
        """Finish a request outside the normal stop checks (abort, failed step); returns its final output."""
        self.scheduler.finish(request, reason)
        output = self._output(request, final=True)
        self._forget(request.request_id)
        return output

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._streams.pop(request_id, None)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
