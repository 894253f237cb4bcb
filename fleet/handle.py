"""A submitted request as its client sees it: events as they come, the output, abort.

Handles read the request's :class:`fleet.request.EventSink`, fed by the fleet loop
thread; every wait is bounded by the request's deadline, ``wait_s`` or the loop's liveness.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from fleet.request import FleetRequest, is_final
from worker.outputs import RequestEvent, RequestOutput

__all__ = ["FleetClosed", "FleetLink", "RequestHandle"]

_POLL_S = 0.5


class FleetClosed(RuntimeError):
    """The fleet is shut down (or its loop stopped): no request can be submitted or awaited."""


@dataclass(frozen=True)
class FleetLink:
    """What a handle may ask of the fleet that made it (the fleet builds one and shares it).

    loop_alive: whether the fleet's loop thread still runs (a stopped loop delivers nothing more).
    stopped_why: why the loop is not running (shut down, or the crash).
    abort: end a request by id; False if the fleet does not know it.
    """

    loop_alive: Callable[[], bool]
    stopped_why: Callable[[], str]
    abort: Callable[[str], bool]


class RequestHandle:
    """A submitted request: its events as they come, its output when done, and abort."""

    def __init__(self, link: FleetLink, request: FleetRequest) -> None:
        self.request_id = request.request_id
        self._link, self._sink, self._timeout_s = link, request.sink, request.timeout_s
        self._submitted = request.submitted
        self._token_times = request.token_times
        self._request = request
        self._output: RequestOutput | None = None
        self._finished = False

    @property
    def submitted(self) -> float:
        """``time.monotonic()`` at which it was submitted to the fleet."""
        return self._submitted

    @property
    def engine_phases(self) -> tuple[float, float] | None:
        """Seconds the request waited in its engine's queue, and from its first step there to its first
        token (:attr:`worker.outputs.RequestEvent.phases`); None until the first token is delivered."""
        return self._request.phases

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens its engine found in the prefix cache (:attr:`worker.outputs.RequestEvent.cached_tokens`);
        0 until the first token is delivered."""
        return self._request.cached_tokens or 0

    @property
    def finished(self) -> bool:
        """Whether the request's final event has been read; its output, if read, always comes after it."""
        return self._finished

    @property
    def token_times(self) -> list[float]:
        """``time.monotonic()`` at which the fleet delivered each output token, in order (tokens that
        arrive in one event, e.g. several steps reported together, share its time).

        Entry ``k`` is there once the event with the ``k``-th token can be read from :meth:`events`;
        after :meth:`result`, every entry is. The first is the first token's time (TTFT), the gaps
        between them the inter-token latencies.
        """
        return self._token_times

    def _deadline(self, wait_s: float | None) -> float | None:
        if wait_s is not None:
            return time.monotonic() + wait_s
        if self._timeout_s is not None:
            return self._submitted + self._timeout_s + 30.0  # the loop ends it at its deadline
        return None

    def _wait_left(self, end: float | None, wait_s: float | None) -> float:
        """Seconds of the next poll; raises when the wait is over or the fleet has stopped."""
        left = _POLL_S if end is None else min(_POLL_S, end - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"request {self.request_id}: no event within {wait_s}s")
        return left

    def _closed(self) -> FleetClosed | None:
        if self._link.loop_alive():
            return None
        return FleetClosed(f"request {self.request_id}: the fleet stopped ({self._link.stopped_why()})")

    def _next(self, wait_s: float | None) -> RequestEvent | RequestOutput:
        """The next item from the loop; waits at most ``wait_s`` (None: until the request's deadline)."""
        end = self._deadline(wait_s)
        while True:
            try:
                return self._sink.get(timeout=self._wait_left(end, wait_s))
            except queue.Empty:
                if (closed := self._closed()) is not None:
                    raise closed from None

    async def _anext(self, wait_s: float | None) -> RequestEvent | RequestOutput:
        """:meth:`_next` for asyncio: awaits on the caller's loop without holding a thread."""
        end = self._deadline(wait_s)
        while True:
            try:
                return await self._sink.aget(timeout=self._wait_left(end, wait_s))
            except queue.Empty:
                if (closed := self._closed()) is not None:
                    raise closed from None

    def _take(self, item: RequestEvent | RequestOutput) -> RequestEvent | None:
        """Record ``item``; the event to hand out, or None for the final output."""
        if isinstance(item, RequestOutput):
            self._output = item
            return None
        if item.finished:
            self._finished = True
        return item

    def events(self, wait_s: float | None = None) -> Iterator[RequestEvent]:
        """Yield this request's events until the final one; ``wait_s`` bounds each wait (TimeoutError)."""
        while not self._finished:
            event = self._take(self._next(wait_s))
            if event is not None:
                yield event

    async def aevents(self, wait_s: float | None = None) -> AsyncIterator[RequestEvent]:
        """:meth:`events` for asyncio (no thread is held while waiting)."""
        while not self._finished:
            event = self._take(await self._anext(wait_s))
            if event is not None:
                yield event

    async def aevent_batches(self, interval_s: float | Callable[[], float], wait_s: float | None = None,
                             ) -> AsyncIterator[list[RequestEvent]]:
        """:meth:`aevents` in batches at most one per ``interval_s`` (Ray Serve LLM's stream batching).

        The first batch goes as soon as there is an event (time to first token is not held back),
        and so does the one with the final event; in between, events that arrive within
        ``interval_s`` of the last batch wait for the next. ``interval_s=0`` hands out what is
        ready whenever the reader wakes. A callable ``interval_s`` is asked before each wait (an
        interval that follows the load: :class:`deploy.stream_pacing.StreamPacer`).
        """
        loop = asyncio.get_running_loop()
        interval = interval_s if callable(interval_s) else (lambda: interval_s)
        last = None
        while not self._finished:
            first = await self._anext(wait_s)
            if last is not None and not is_final(first) and (wait := interval()) > 0:
                left = last + wait - loop.time()
                if left > 0:
                    await self._sink.ahold(left)
            items = [first, *self._sink.drain()]
            last = loop.time()
            batch = [e for e in map(self._take, items) if e is not None]
            if batch:
                yield batch

    def result(self, wait_s: float | None = None) -> RequestOutput:
        """Wait for the request to end; ``wait_s`` bounds each wait between events (TimeoutError)."""
        while self._output is None:
            self._take(self._next(wait_s))
        return self._output

    async def aresult(self, wait_s: float | None = None) -> RequestOutput:
        """:meth:`result` for asyncio (no thread is held while waiting)."""
        while self._output is None:
            self._take(await self._anext(wait_s))
        return self._output

    def abort(self) -> bool:
        """End the request with finish_reason "abort" (see :meth:`fleet.fleet.Fleet.abort`)."""
        return self._link.abort(self.request_id)
