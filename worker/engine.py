"""The engine: requests, scheduler, step pipeline and output processor over an executor.

``Engine(config)`` loads the checkpoint named by ``config.model.path`` into a local worker,
sizes the paged KV cache and serves requests with continuous batching, driven by the caller:
each ``step`` sends one prefill, decode or mixed batch (:mod:`worker.scheduler`) and reads one
back (the same batch, or with ``scheduler.async_scheduling`` the one sent by the step before:
:mod:`worker.step_pipeline`), and the tokens read back become request events
(:mod:`worker.output_processor`). ``generate`` and ``stream`` drive ``step`` until their requests
finish (other requests in the engine advance too).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from graphs.budget import ReplanSummary
from graphs.profile import BatchProfile
from worker.admission import PromptLimits, encode_prompt
from worker.config import EngineConfig
from worker.executor import Executor
from worker.kv_cache import PageAllocator
from worker.output_processor import OutputProcessor
from worker.outputs import RequestEvent, RequestOutput, StepStats
from worker.page_table import PageTable
from worker.prefix_cache import PrefixCachePool
from worker.prefix_cache_metrics import PrefixCacheMetrics
from worker.request import Request, RequestRejected, Status
from worker.sampling.packed_rows import spelled_entries
from worker.sampling.params import SamplingParams
from worker.scheduler import Scheduler, SchedulerLimits
from worker.step_pipeline import StepPipeline
from worker.tokenizer import Tokenizer, load_tokenizer
from worker.worker import Worker

log = logging.getLogger(__name__)


@dataclass
class ReplanOutcome:
    """:meth:`Engine.replan`'s result: the events of the step read back before it, and the summary
    (or why it was refused)."""

    events: list[RequestEvent]
    summary: ReplanSummary | None
    error: str | None


class Engine:
    """Continuous-batching inference: scheduler, step pipeline and output processor over an executor.

    Without ``executor`` the engine builds a local :class:`Worker` (one process, one device);
    ``cluster.group.WorkerGroup`` is the tensor-parallel executor.
    """

    def __init__(self, config: EngineConfig, registry: CollectorRegistry | None = None,
                 executor: Executor | None = None, tokenizer: Tokenizer | None = None,
                 metric_labels: dict[str, str] | None = None) -> None:
        """``tokenizer``: the checkpoint's, when the caller has loaded it already (a fleet shares one
        among its engines); None loads it from ``model.path`` (if it has a ``tokenizer.json``).
        The engine's own metrics (``prefix_cache_*``) go to ``registry`` (else the local worker's)
        with constant ``metric_labels``."""
        if not config.model.path:
            raise ValueError("model.path is not set: pass a checkpoint directory (--model DIR)")
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.path)
        self.executor = executor if executor is not None else Worker.local(config, registry)
        self.arch = self.executor.arch
        page_size = config.cache.page_size
        num_pages = self.executor.num_pages
        self._max_model_len = self.executor.max_len
        sched = config.scheduler
        prefix_caching = config.cache.prefix_caching
        self.allocator = PrefixCachePool(num_pages) if prefix_caching else PageAllocator(num_pages)
        self.scheduler = Scheduler(
            SchedulerLimits(sched.max_running_requests, sched.max_num_batched_tokens,
                            sched.chunked_prefill_size, page_size, sched.mixed_steps, sched.mixed_prefill_tokens,
                            sched.defer_shared_prefixes),
            self.allocator, self.max_model_len)
        registry = registry if registry is not None else getattr(self.executor, "registry", None)
        if registry is not None:
            PrefixCacheMetrics(self.scheduler.cache_stats, registry, metric_labels)
        self.async_scheduling = sched.async_scheduling
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.arch.eos_token_ids,
                                                self.max_model_len)
        self.pipeline = StepPipeline(self.executor, self.scheduler, self.allocator, self.output_processor,
                                     self.async_scheduling)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._rng = random.Random(config.model.seed)
        log.info("engine ready: %d KV pages of %d tokens, max_model_len %d, prefix caching %s", num_pages,
                 page_size, self.max_model_len, "on" if prefix_caching else "off")

    @property
    def worker(self) -> Worker:
        """The local worker (only for an engine built without an executor)."""
        if not isinstance(self.executor, Worker):
            raise AttributeError("this engine runs on a worker group, not a local worker")
        return self.executor

    def shutdown(self) -> None:
        """Shut the executor down (graphs released before what they point at)."""
        self.executor.shutdown()

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt plus output) this engine runs."""
        return self._max_model_len

    def cap_max_model_len(self, max_model_len: int) -> None:
        """Stop sequences at ``max_model_len`` (at most the executor's): a fleet caps every engine at its
        shortest, so where a request runs never changes where it ends. The scheduler and the output
        processor stop at the new length from the next step on."""
        if not 1 <= max_model_len <= self.executor.max_len:
            raise ValueError(f"max_model_len {max_model_len} outside [1, {self.executor.max_len}] (the executor's)")
        self._max_model_len = self.scheduler.max_model_len = self.output_processor.max_model_len = max_model_len

    @property
    def step_stats(self) -> deque[StepStats]:
        """What the last 10,000 steps did (:class:`worker.outputs.StepStats`), oldest first."""
        return self.pipeline.step_stats

    @property
    def errors(self) -> dict[str, str]:
        """Why each request that ended with ``finish_reason="error"`` did (by request id)."""
        return self.output_processor.errors

    # ----- requests -----

    @property
    def num_free_pages(self) -> int:
        """KV pages free for new requests now (cached pages no request holds count: they are evictable)."""
        return self.allocator.num_free

    @property
    def prefix_cache_stats(self):
        """Tokens looked up in the prefix cache and found there (:class:`worker.scheduler.PrefixCacheStats`)."""
        return self.scheduler.cache_stats

    @property
    def prompt_limits(self) -> PromptLimits:
        """What a prompt must satisfy here (``max_model_len`` as it is now: a fleet lowers it to its shortest)."""
        return PromptLimits(self.arch.vocab_size, self.max_model_len)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises :class:`RequestRejected` (naming the problem) and changes nothing."""
        params = params or SamplingParams()
        ids = encode_prompt(prompt, self.tokenizer)
        self.prompt_limits.check(ids)
        self.prompt_limits.check_params(params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use")
        seed = params.effective_seed(self._rng)
        req = Request(rid, ids, params, seed, next(self._arrivals))
        self._register(req)
        self.scheduler.add(req)
        return rid

    def _register(self, req: Request, on_first_token: Callable[[Request], None] | None = None) -> None:
        """Track ``req`` and give it an output text primed with the tokens it already has."""
        self.requests[req.request_id] = req
        self.output_processor.add(req, on_first_token)

    def _resumed(self, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams, seed: int,
                 request_id: str, logprobs: Sequence[float]) -> Request:
        ids = [int(t) for t in prompt_ids]
        self.prompt_limits.check(ids)
        self.prompt_limits.check_params(params)
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        req = Request(request_id, ids, params, seed, next(self._arrivals))
        req.output_ids = [int(t) for t in output_ids]
        req.logprobs = list(logprobs)
        if req.num_tokens >= self.max_model_len:
            raise RequestRejected(f"request has {req.num_tokens} tokens; max_model_len is {self.max_model_len}")
        return req

    # ----- requests moved between engines (the fleet) -----

    def admit(self, prompt_ids: Sequence[int], params: SamplingParams, *, seed: int, request_id: str,
              output_ids: Sequence[int] = (), logprobs: Sequence[float] = (),
              on_first_token: Callable[[Request], None] | None = None, expected_cached_tokens: int = 0) -> str:
        """Queue a request for prefill with a caller-chosen ``seed``, resuming ``output_ids`` if given.

        The request prefills ``prompt_ids + output_ids`` and samples output token
        ``len(output_ids)`` exactly as it would have in one engine. With ``on_first_token``, the
        request is handed off after that token: unless it finishes there (stop, EOS, length),
        ``on_first_token(request)`` runs while its pages still hold the KV of every token but the
        new one (it must copy them or order its copy before the next step, and must not raise),
        then the request finishes here with reason ``handoff`` (its text is not flushed).
        ``expected_cached_tokens``: the prefix the fleet's router expects cached here
        (:attr:`Request.expected_cached_tokens`); it changes no output.
        """
        if on_first_token is not None and self.async_scheduling:
            raise RequestRejected("a hand-off after the first token needs scheduler.async_scheduling=false "
                                  "(the next step would already be on its way)")
        req = self._resumed(prompt_ids, output_ids, params, seed, request_id, logprobs)
        req.expected_cached_tokens = expected_cached_tokens
        self._register(req, on_first_token)
        self.scheduler.add(req)
        return request_id

    def add_prefilled_request(self, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams,
                              *, seed: int, request_id: str, import_kv: Callable[[list[int]], object],
                              logprobs: Sequence[float] = ()) -> str:
        """Admit a request whose KV was computed elsewhere; it continues with the next decode step.

        ``output_ids`` (at least one) are the tokens sampled so far; the KV of every token but the
        last is imported by ``import_kv(pages)`` into pages allocated here. If ``import_kv`` raises,
        the pages are freed, nothing is admitted, and the error propagates.
        """
        if not output_ids:
            raise RequestRejected("a prefilled request needs its first output token")
        req = self._resumed(prompt_ids, output_ids, params, seed, request_id, logprobs)
        num_kv = req.num_tokens - 1
        full = self.no_room_for_prefilled(num_kv)
        if full is not None:
            raise RequestRejected(full)
        req.pages = PageTable(self.allocator.allocate(req.pages_needed(num_kv, self.config.cache.page_size)))
        try:
            import_kv(list(req.pages))
        except BaseException:
            self.allocator.free(req.pages)
            raise
        req.num_computed = num_kv
        req.prefilling = False
        req.first_token_time = time.monotonic()
        self._register(req)
        self.scheduler.add_running(req)
        return request_id

    def no_room_for_prefilled(self, num_kv_tokens: int, reserved_pages: int = 0,
                              reserved_requests: int = 0) -> str | None:
        """Why a prefilled request with ``num_kv_tokens`` of KV cannot be admitted now (no running slot
        or not enough free pages, after ``reserved_requests`` others taking ``reserved_pages``), or
        None when it can."""
        running, limit = len(self.scheduler.running) + reserved_requests, self.config.scheduler.max_running_requests
        if running >= limit:
            held = f" ({reserved_requests} of them waiting for their KV)" if reserved_requests else ""
            return f"{running} requests already running{held} (scheduler.max_running_requests={limit})"
        need = -(-num_kv_tokens // self.config.cache.page_size)
        if not self.allocator.can_allocate(need + reserved_pages):
            held = f" ({reserved_pages} held for KV on its way)" if reserved_pages else ""
            return f"needs {need} KV pages, {self.allocator.num_free} free{held}"
        return None

    def abort(self, request_id: str) -> bool:
        """Finish ``request_id`` with reason ``abort`` and free its pages; False if unknown/finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self.output_processor.drop_handoff(request_id)
        self.scheduler.finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        """Whether a request is waiting or running, or a step is still in flight."""
        return self.scheduler.has_work() or self.pipeline.in_flight

    @property
    def in_flight(self) -> bool:
        """Whether a step is sent and not read back (async scheduling)."""
        return self.pipeline.in_flight

    # ----- stepping -----

    def step(self) -> list[RequestEvent]:
        """Send the next prefill, decode or mixed batch (if any) and read one back; the events of the
        requests it advanced.

        Synchronously the batch read back is the one just sent. With ``scheduler.async_scheduling``
        a call sends the next batch and then reads back the one sent by the call before (see
        :mod:`worker.step_pipeline`): its events are that batch's.
        """
        return self.pipeline.step()

    def replan(self, profile: BatchProfile | None = None) -> ReplanOutcome:
        """Re-plan the executor's graph ladders between steps (see :meth:`worker.worker.Worker.replan`).

        The step in flight is read back first (its events are in the outcome), so the swap happens
        with nothing running; the requests go on with the next :meth:`step`. A refused re-plan
        (no room in the graph budget) changes nothing and is the outcome's ``error``."""
        replan = getattr(self.executor, "replan", None)
        if replan is None:
            return ReplanOutcome([], None, f"{type(self.executor).__name__} cannot re-plan graphs")
        events = self.pipeline.flush()
        try:
            return ReplanOutcome(events, replan(profile), None)
        except ValueError as e:
            return ReplanOutcome(events, None, str(e))

    def output(self, request_id: str) -> RequestOutput:
        """``request_id``'s tokens, text and finish reason so far (until :meth:`release`)."""
        req = self.requests[request_id]
        return RequestOutput(req.request_id, list(req.prompt_ids), list(req.output_ids),
                             self.output_processor.text(request_id), req.finish_reason,
                             spelled_entries(req.logprobs) if req.params.logprobs else None, req.num_preemptions,
                             stop_reason=req.stop_reason, cached_tokens=req.cached_tokens or 0,
                             prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None
                             else None)

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping."""
        req = self.requests.get(request_id)
        if req is not None and req.status is Status.FINISHED:
            del self.requests[request_id]
            self.output_processor.forget(request_id)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion (batched) and return their outputs in order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        self._drain()
        outputs = [self.output(i) for i in ids]
        for i in ids:
            self.release(i)
        return outputs

    def _drain(self) -> None:
        """With nothing left to schedule, read back the step still in flight (async scheduling): its
        tokens are dropped, and the pages it held come back now."""
        while self.in_flight and not self.scheduler.has_work():
            self.step()

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestEvent]:
        """Yield this request's events as the engine steps; closing the iterator aborts it."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for ev in self.step():
                    if ev.request_id == rid:
                        yield ev
                        if ev.finished:
                            return
                if self.requests[rid].finished:
                    return
        finally:
            self.abort(rid)
            self._drain()
            self.release(rid)
