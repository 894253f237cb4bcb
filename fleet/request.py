"""One request as the fleet tracks it across groups (owned by the fleet's loop thread)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field

from worker.outputs import FailureKind, RequestEvent, RequestOutput
from worker.sampling.packed_rows import spelled_entries
from worker.sampling.params import SamplingParams


def _wake(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the reader's loop is closed: nobody is waiting any more
        pass


def _set_all(events: list[asyncio.Event]) -> None:
    for ready in events:
        ready.set()


class Wakeups:
    """Batches the wake-ups of asyncio readers that the sinks' producer sends.

    Outside :meth:`deferred` a put wakes its reader's loop at once (one ``call_soon_threadsafe``
    each). Inside it, wake-ups wait for :meth:`flush` (or the end of the block), which wakes each
    reader loop once for all of them: a step that delivers 64 streams' tokens costs one cross-thread
    call, not 64 (each of which hands the GIL to the reader loop mid-delivery). Used by one thread
    only: the fleet loop, the sinks' only producer.
    """

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] | None = None

    @contextlib.contextmanager
    def deferred(self):
        if self._pending is not None:  # nested: the outer block flushes
            yield
            return
        self._pending = {}
        try:
            yield
        finally:
            self.flush()
            self._pending = None

    def flush(self) -> None:
        """Wake every reader loop with pending wake-ups (no-op outside :meth:`deferred`)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for loop, events in pending.items():
            _wake(loop, _set_all, events)

    def wake(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Event) -> None:
        if self._pending is None:
            _wake(loop, ready.set)
        else:
            self._pending.setdefault(loop, []).append(ready)


def is_final(item) -> bool:
    """Whether ``item`` ends a request's stream: its finished event or its output."""
    return isinstance(item, RequestOutput) or (isinstance(item, RequestEvent) and item.finished)


class EventSink:
    """Where the fleet's loop thread delivers one request's events and output, in order.

    Readers either block on :meth:`get` (a thread) or await :meth:`aget` (an asyncio loop: no
    thread is held while the request runs, so a server with many open streams does not run out
    of executor threads). Each ``put`` wakes the loop an asynchronous reader waits in, at once or,
    with the producer's ``wakeups`` deferring, at its next flush. A reader that batches its stream
    :meth:`ahold` s between reads: during a hold only a final item wakes it, so the tokens of the
    steps in between cost the reader nothing until it :meth:`drain` s them together.
    """

    def __init__(self, wakeups: Wakeups | None = None) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._holding = False
        self._final_put = False
        self._wakeups = wakeups if wakeups is not None else Wakeups()  # its own: never deferring

    def put(self, item) -> None:
        self._items.put(item)
        final = is_final(item)
        with self._lock:
            self._final_put = self._final_put or final
            waiter = None if self._holding and not final else self._waiter
        if waiter is not None:
            self._wakeups.wake(*waiter)

    def get(self, timeout: float | None = None):
        """The next item; raises ``queue.Empty`` after ``timeout`` seconds."""
        return self._items.get(timeout=timeout)

    def drain(self) -> list:
        """Every item delivered so far and not yet taken (no wait)."""
        items = []
        while True:
            try:
                items.append(self._items.get_nowait())
            except queue.Empty:
                return items

    def _ready_event(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        with self._lock:
            if self._waiter is None or self._waiter[0] is not loop:
                self._waiter = (loop, asyncio.Event())
            return self._waiter[1]

    async def aget(self, timeout: float):
        """The next item, awaited; raises ``queue.Empty`` after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        ready = self._ready_event(loop)
        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                pass
            ready.clear()
            # Cleared before this second look: an item put after it sets ``ready`` again (no lost
            # wake-up). A set from an earlier put whose item was already taken wakes us for nothing:
            # hence the loop.
            try:
                return self._items.get_nowait()
            except queue.Empty:
                pass
            left = deadline - loop.time()
            if left <= 0:
                raise queue.Empty
            try:
                await asyncio.wait_for(ready.wait(), left)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                pass

    async def ahold(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the request's final item is (or gets) delivered."""
        # A fresh event: a wake-up already scheduled for the old one (a token put just before the
        # hold) must not end the hold.
        ready = asyncio.Event()
        with self._lock:
            self._waiter = (asyncio.get_running_loop(), ready)
            self._holding = True
            final = self._final_put
        try:
            if not final:
                await asyncio.wait_for(ready.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                self._holding = False


@dataclass(eq=False)
class FleetRequest:
    """A request's fleet-wide state: what the client has been sent, and where the request is now.

    ``output_ids``/``logprobs``/``text`` are exactly what was delivered to the client, so a request
    moved to another group resumes from them (the group re-prefills prompt + output and samples
    output token ``len(output_ids)`` with the same seed). ``member`` is the group whose engine holds
    it (as ``engine_id``); ``payload`` its staged KV, from its prefill until a decode group has
    imported it (``shards``: what that group was sent); neither while it is queued.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    timeout_s: float | None
    sink: EventSink = field(default_factory=EventSink)
    submitted: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    attempts: int = 0  # prefills started
    moves: int = 0  # times its KV was lost (group failure, failed hand-off) and it was requeued
    member: object = None
    engine_id: str | None = None
    payload: object = None
    shards: tuple | None = None
    holds_admission: bool = True  # counts against the router's queue bound until first dispatched
    last_failure: str | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic delivery time of each token
    phases: tuple[float, float] | None = None  # the engine's queue and prefill seconds (RequestEvent.phases)
    prompt_logprobs: list | None = None  # RequestEvent.prompt_logprobs, from the first event that has them
    cached_tokens: int | None = None  # RequestEvent.cached_tokens, from the first event that has them
    prefix_keys: list | None = None  # the router's page keys of its leading prompt pages (Router.page_keys)

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.submitted + self.timeout_s

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def remaining_output(self, max_model_len: int) -> int:
        return max(0, min(self.params.max_tokens - len(self.output_ids), max_model_len - self.num_tokens))

    def deliver(self, event: RequestEvent) -> None:
        """Record ``event`` as sent (with its time, if it carries tokens) and send it to the client."""
        if event.token_ids:  # before the put: a reader of token k sees time k
            self.token_times.extend([time.monotonic()] * len(event.token_ids))
        if event.phases is not None and self.phases is None:
            self.phases = event.phases
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.cached_tokens is not None and self.cached_tokens is None:
            self.cached_tokens = event.cached_tokens
        self.output_ids.extend(event.token_ids)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        self.text += event.text
        self.sink.put(event)

    def finish(self, reason: str, error: str | None = None, event: RequestEvent | None = None,
               failure: FailureKind | None = None) -> RequestOutput:
        """Send the final event (``event``, or an empty one) and then the request's output; ``error``
        and ``failure`` say why and what kind, when ``reason`` is "error"."""
        if event is None:
            event = RequestEvent(self.request_id, [], "", True, reason, None, error, failure)
        self.deliver(event)
        out = RequestOutput(self.request_id, list(self.prompt_ids), list(self.output_ids), self.text, reason,
                            spelled_entries(self.logprobs) if self.params.logprobs else None, self.moves, error,
                            failure, event.stop_reason, self.prompt_logprobs, self.cached_tokens or 0)
        self.sink.put(out)
        return out
