"""How the engine sends steps and reads them back: at once, or one step ahead (async scheduling).

:class:`StepPipeline` owns the step in flight. Both modes share one path: a scheduled batch is
sent (``Executor.submit``) and marked in flight on its requests, then read back: each sampled
token goes to the pipeline's :class:`TokenConsumer` (the engine's
:class:`worker.output_processor.OutputProcessor`), which turns it into the request's event, and
the step's stats are kept. Synchronously the read-back follows the send at once.

With ``scheduler.async_scheduling`` the engine sends step N+1 before it reads step N's tokens
back: while the ranks compute step N, the engine schedules step N+1, builds its message and
sends it; only then does it wait for step N. The hop to the ranks and the engine's host work
overlap the ranks' compute, so with ``Executor.submit`` queueing steps (a worker group) a rank
starts step N+1 as soon as step N ends.

A decode row of step N+1 whose input token is step N's sample carries a stand-in 0 and
``from_previous`` names the sampled row of step N it comes from; every rank fills it from the
tokens it sampled itself (all ranks sample the same). Invariants:

- At most two steps are in flight inside :meth:`StepPipeline.step` and one between calls;
  steps run in the order they are sent, so step N+1's stand-in inputs always refer to step N.
- ``Request.num_pending`` counts a request's tokens sampled by steps in flight; the scheduler
  sees ``seq_len = num_tokens + num_pending`` and sends no step for a request whose pending
  tokens already end it by length. A request that ends on EOS or a stop string when step N is
  read back was also in step N+1: that token is dropped, as is any token of a request that was
  aborted, finished or preempted (its preemption count moved on) after its step was sent.
- A page freed while a step is in flight may still be written by it: the allocator holds it
  back (``PageAllocator.hold``) until every step sent before the free has been read back.
  Otherwise a KV import into a reused page could race the step's late write.
- A failed step loses both steps in flight: every running request is preempted (recomputed)
  and held pages are released (the failed ranks write nothing more); the prefix cache is
  emptied, since pages registered when the lost steps were sent may never have been written.
- With prefix caching a page is registered when the step that fills it is sent
  (``Scheduler.cache_full_pages``): a later step that reads it runs after that one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from worker.executor import Executor, ExecutorFailed, ExecutorUnavailable, PendingStep
from worker.kv_cache import PageAllocator
from worker.outputs import RequestEvent, StepStats
from worker.request import Request
from worker.sampling.packed_rows import first_alternatives, row_width
from worker.scheduler import ScheduledBatch, Scheduler
from worker.step_message import build_step_message

log = logging.getLogger(__name__)


class TokenConsumer(Protocol):
    """Where the pipeline's sampled tokens go (the engine's output processor)."""

    def append_tokens(self, sampled: list[tuple[Request, int, float | None]]) -> list[RequestEvent]:
        """Append each ``(request, token, logprob)`` of a step in order (each request still running
        when its token is appended) and return their events."""

    def fail_all(self, reason: str) -> list[RequestEvent]:
        """End every request with an error: no executor will run steps any more."""


@dataclass
class InFlightStep:
    """A step sent and not yet read back."""

    batch: ScheduledBatch
    sent: PendingStep
    sampled: list[tuple[Request, int]]  # per sampled row: the request and its preemption count when sent
    rows: dict[int, int]  # id(request) -> its sampled row (the next step's ``previous_rows``)
    sent_at: float  # time.perf_counter() when it was handed to the executor
    held: list[int] = field(default_factory=list)  # pages freed while it was the newest step in flight
    scored: list = field(default_factory=list)  # StepMessage.scored_prompts: whose prompt positions it scores


class StepPipeline:
    """Sends the scheduler's batches to ``executor`` and reads their tokens back into ``consumer``.

    ``async_scheduling`` picks the mode (see the module docstring); ``step_stats`` keeps the
    last 10,000 steps' :class:`StepStats`.
    """

    def __init__(self, executor: Executor, scheduler: Scheduler, allocator: PageAllocator, consumer: TokenConsumer,
                 async_scheduling: bool) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.allocator = allocator
        self.consumer = consumer
        self.async_scheduling = async_scheduling
        self.step_stats: deque[StepStats] = deque(maxlen=10_000)
        self._in_flight: InFlightStep | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a step is sent and not read back (async scheduling, between calls)."""
        return self._in_flight is not None

    def step(self) -> list[RequestEvent]:
        """One engine step: the events of the batch read back by it (see the module docstring)."""
        return self._async_step() if self.async_scheduling else self._sync_step()

    def flush(self) -> list[RequestEvent]:
        """Read back the step in flight, sending nothing after it (async scheduling); its events.

        Afterwards no step is in flight, so the executor may change what the next step runs on
        (a re-plan swaps the graphs)."""
        previous = self._in_flight
        if previous is None:
            return []
        self._in_flight = None
        previous.held.extend(self.allocator.take_held())
        return self._read_back(previous, time.perf_counter())

    def _sync_step(self) -> list[RequestEvent]:
        """Send the next batch (if any) and read it back; its events."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        start = time.perf_counter()
        try:
            step = self._send(batch, None)
        except (ExecutorFailed, ExecutorUnavailable) as e:
            return self._lost(e)
        return self._read_back(step, start, waited_from=step.sent_at)

    def _async_step(self) -> list[RequestEvent]:
        """Send the next batch (if any), then read back the step sent before; its events."""
        start = time.perf_counter()
        previous, allocator = self._in_flight, self.allocator
        batch = self.scheduler.schedule()
        current = None
        if batch is not None:
            try:
                current = self._send(batch, previous)
            except (ExecutorFailed, ExecutorUnavailable) as e:
                return self._lost(e, previous)
            allocator.hold()
        # Pages freed since the last look were freed while ``previous`` was the newest step in flight.
        held = allocator.take_held()
        if previous is not None:
            previous.held.extend(held)
        else:
            allocator.release(held)
        self._in_flight = current
        if previous is None:
            if current is None:
                allocator.stop_holding()
            return []
        return self._read_back(previous, start)

    def _send(self, batch: ScheduledBatch, previous: InFlightStep | None) -> InFlightStep:
        """Send ``batch`` (its inputs in flight come from ``previous``) and mark it on its requests."""
        seeds = [r.seed for r, s in zip(batch.requests, batch.sample) if s]
        msg = build_step_message(batch, seeds, previous_rows=previous.rows if previous is not None else None)
        sent_at = time.perf_counter()
        sent = self.executor.submit(msg)
        sampled, rows = [], {}
        for req, n, sample_row in zip(batch.requests, batch.num_new, batch.sample):
            req.num_computed += n
            if sample_row:
                rows[id(req)] = len(sampled)
                sampled.append((req, req.num_preemptions))
                req.num_pending += 1
                req.prefilling = False  # its next step decodes the token in flight
        self.scheduler.cache_full_pages(batch.requests)
        return InFlightStep(batch, sent, sampled, rows, sent_at, scored=msg.scored_prompts)

    def _read_back(self, step: InFlightStep, start: float, waited_from: float | None = None) -> list[RequestEvent]:
        """Wait for ``step``'s tokens (``execute_s`` counts from ``waited_from``, else from now) and
        hand them to their requests; ``start`` is when this engine step began."""
        waited = time.perf_counter() if waited_from is None else waited_from
        try:
            result = step.sent.result()
        except (ExecutorFailed, ExecutorUnavailable) as e:
            return self._lost(e, step)
        execute_s = time.perf_counter() - waited
        landed = []
        logprobs = result.logprobs if result.logprobs is not None else [None] * len(result.token_ids)
        tops = result.top_logprobs
        # every row's (logprob, ids, logprobs) entry built in one pass (the rows' bytes, packed_rows),
        # kept whole for a row that asked for all of them
        entries = list(zip(logprobs, *tops)) if tops is not None else None
        width = row_width(tops[0]) if tops is not None else 0
        for row, ((req, preemptions), token, lp) in enumerate(zip(step.sampled, result.token_ids, logprobs)):
            if req.finished or req.num_preemptions != preemptions:
                continue  # ended or restarted after this step was sent: the token is not its
            req.num_pending -= 1
            k = req.params.top_logprobs
            if k and entries is not None:
                entry = entries[row]
                lp = entry if k == width else (lp, *first_alternatives(entry[1], entry[2], k))
            landed.append((req, token, lp))
        if step.scored and result.prompt_logprobs is not None:
            _land_prompt_logprobs(step.scored, result.prompt_logprobs)
        events = self.consumer.append_tokens(landed)
        self.allocator.release(step.held)
        if self._in_flight is None:
            self.allocator.stop_holding()
        batch = step.batch
        self.step_stats.append(StepStats(batch.phase, batch.size, batch.num_tokens,
                                         time.perf_counter() - start, execute_s, result.rank_s,
                                         result.wait_s, result.wait_cpu_s))
        return events

    def _lost(self, error: Exception, *steps: InFlightStep | None) -> list[RequestEvent]:
        """Every step in flight is gone with the executor: recompute (or, with no executor, end) them."""
        in_flight = {id(s): s for s in (*steps, self._in_flight) if s is not None}
        self._in_flight = None
        for s in in_flight.values():
            self.allocator.release(s.held)
        self.allocator.stop_holding()
        if isinstance(error, ExecutorUnavailable):
            events = self.consumer.fail_all(str(error))
            log.error("no executor (%s); ended %d requests with an error", error, len(events))
            return events
        n = self.scheduler.preempt_all()
        log.error("step failed (%s); %d running requests re-queued for recomputation", error, n)
        return []


def _land_prompt_logprobs(scored: list, values: tuple) -> None:
    """Append a step's prompt log-probabilities to their requests: each run of positions only where
    it continues what the request has (a run computed again after a preemption, or one whose request
    ended, is dropped)."""
    lps, ids, vals = values
    at = 0
    for req, first, count in scored:
        if not req.finished and len(req.prompt_logprobs) == first:
            k = req.params.prompt_logprobs
            req.prompt_logprobs.extend((lps[j], ids[j][:k], vals[j][:k]) for j in range(at, at + count))
        at += count
