"""How the engine sends steps and reads them back: at once, or one step ahead (async scheduling).

Both modes share one path: a scheduled batch is sent (``Executor.submit``) and marked in flight
on its requests, then read back (tokens appended, events made, stats kept). Synchronously
(:func:`sync_step`) the read-back follows the send at once.

With ``scheduler.async_scheduling`` (:func:`async_step`) the engine sends step N+1 before it
reads step N's tokens back: while the ranks compute step N, the engine schedules step N+1,
builds its message and sends it; only then does it wait for step N. The hop to the ranks and
the engine's host work overlap the ranks' compute, so with ``Executor.submit`` queueing steps
(a worker group) a rank starts step N+1 as soon as step N ends.

A decode row of step N+1 whose input token is step N's sample carries a stand-in 0 and
``from_previous`` names the sampled row of step N it comes from; every rank fills it from the
tokens it sampled itself (all ranks sample the same). Invariants:

- At most two steps are in flight inside :func:`async_step` and one between calls; steps run
  in the order they are sent, so step N+1's stand-in inputs always refer to step N.
- ``Request.num_pending`` counts a request's tokens sampled by steps in flight; the scheduler
  sees ``seq_len = num_tokens + num_pending`` and sends no step for a request whose pending
  tokens already end it by length. A request that ends on EOS or a stop string when step N is
  read back was also in step N+1: that token is dropped, as is any token of a request that was
  aborted, finished or preempted (its preemption count moved on) after its step was sent.
- A page freed while a step is in flight may still be written by it: the allocator holds it
  back (``PageAllocator.hold``) until every step sent before the free has been read back.
  Otherwise a KV import into a reused page could race the step's late write.
- A failed step loses both steps in flight: every running request is preempted (recomputed)
  and held pages are released (the failed ranks write nothing more).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.executor import ExecutorFailed, ExecutorUnavailable, PendingStep
from worker.request import Request
from worker.scheduler import ScheduledBatch
from worker.step_message import build_step_message

if TYPE_CHECKING:
    from worker.engine import Engine
    from worker.outputs import RequestEvent

log = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    """A step sent and not yet read back."""

    batch: ScheduledBatch
    sent: PendingStep
    sampled: list[tuple[Request, int]]  # per sampled row: the request and its preemption count when sent
    rows: dict[int, int]  # id(request) -> its sampled row (the next step's ``previous_rows``)
    sent_at: float  # time.perf_counter() when it was handed to the executor
    held: list[int] = field(default_factory=list)  # pages freed while it was the newest step in flight


def sync_step(engine: Engine) -> list[RequestEvent]:
    """Send the next batch (if any) and read it back; its events."""
    batch = engine.scheduler.schedule()
    if batch is None:
        return []
    start = time.perf_counter()
    try:
        step = _send(engine, batch, None)
    except (ExecutorFailed, ExecutorUnavailable) as e:
        return _lost(engine, e)
    return _read_back(engine, step, start, waited_from=step.sent_at)


def async_step(engine: Engine) -> list[RequestEvent]:
    """Send the next batch (if any), then read back the step sent before; its events."""
    start = time.perf_counter()
    previous, allocator = engine._inflight, engine.allocator
    batch = engine.scheduler.schedule()
    current = None
    if batch is not None:
        try:
            current = _send(engine, batch, previous)
        except (ExecutorFailed, ExecutorUnavailable) as e:
            return _lost(engine, e, previous)
        allocator.hold()
    # Pages freed since the last look were freed while ``previous`` was the newest step in flight.
    held = allocator.take_held()
    if previous is not None:
        previous.held.extend(held)
    else:
        allocator.release(held)
    engine._inflight = current
    if previous is None:
        if current is None:
            allocator.stop_holding()
        return []
    return _read_back(engine, previous, start)


def _send(engine: Engine, batch: ScheduledBatch, previous: InFlightStep | None) -> InFlightStep:
    """Send ``batch`` (its inputs in flight come from ``previous``) and mark it on its requests."""
    seeds = [r.seed for r, s in zip(batch.requests, batch.sample) if s]
    msg = build_step_message(batch, seeds, previous_rows=previous.rows if previous is not None else None)
    sent_at = time.perf_counter()
    sent = engine.executor.submit(msg)
    sampled, rows = [], {}
    for req, n, sample_row in zip(batch.requests, batch.num_new, batch.sample):
        req.num_computed += n
        if sample_row:
            rows[id(req)] = len(sampled)
            sampled.append((req, req.num_preemptions))
            req.num_pending += 1
            req.prefilling = False  # its next step decodes the token in flight
    return InFlightStep(batch, sent, sampled, rows, sent_at)


def _read_back(engine: Engine, step: InFlightStep, start: float, waited_from: float | None = None,
               ) -> list[RequestEvent]:
    """Wait for ``step``'s tokens (``execute_s`` counts from ``waited_from``, else from now) and
    hand them to their requests; ``start`` is when this engine step began."""
    from worker.outputs import StepStats

    waited = time.perf_counter() if waited_from is None else waited_from
    try:
        result = step.sent.result()
    except (ExecutorFailed, ExecutorUnavailable) as e:
        return _lost(engine, e, step)
    execute_s = time.perf_counter() - waited
    events = []
    logprobs = result.logprobs if result.logprobs is not None else [None] * len(result.token_ids)
    for (req, preemptions), token, lp in zip(step.sampled, result.token_ids, logprobs):
        if req.finished or req.num_preemptions != preemptions:
            continue  # ended or restarted after this step was sent: the token is not its
        req.num_pending -= 1
        events.append(engine._append_token(req, token, lp))
    engine.allocator.release(step.held)
    if engine._inflight is None:
        engine.allocator.stop_holding()
    batch = step.batch
    engine.step_stats.append(StepStats("prefill" if batch.is_prefill else "decode", batch.size, batch.num_tokens,
                                       time.perf_counter() - start, execute_s, result.rank_s))
    return events


def _lost(engine: Engine, error: Exception, *steps: InFlightStep | None) -> list[RequestEvent]:
    """Every step in flight is gone with the executor: recompute (or, with no executor, end) them."""
    inflight = {id(s): s for s in (*steps, engine._inflight) if s is not None}
    engine._inflight = None
    for s in inflight.values():
        engine.allocator.release(s.held)
    engine.allocator.stop_holding()
    if isinstance(error, ExecutorUnavailable):
        log.error("no executor (%s); ending %d requests with an error", error, len(engine.requests))
        return engine._fail_all(str(error))
    n = engine.scheduler.preempt_all()
    log.error("step failed (%s); %d running requests re-queued for recomputation", error, n)
    return []
