"""Request routing: a bounded admission queue, and the choice of prefill and decode group per request.

The router holds two FIFO queues, both owned by the fleet's loop thread: ``queue`` (requests
waiting for a prefill-capable group: new ones, and ones moved off a failed group) and
``handoffs`` (prefilled requests whose KV waits for a decode group). A group is chosen as late
as possible, when it can take the request now: among ready groups with room for another running request and
enough free KV pages (keeping one page of headroom per running request, as the scheduler does),
the one with the fewest outstanding tokens. The decode group is chosen at hand-off time, not at
admission, so it reflects the decode load when the KV is ready.

Backpressure: only new requests count against ``scheduler.max_waiting_requests`` (checked in the caller's
thread by :class:`AdmissionGate`); a request already accepted is never refused later.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fleet.request import FleetRequest


class Overloaded(RuntimeError):
    """The fleet's waiting queue is full; retry later (an HTTP server answers 429)."""


class AdmissionGate:
    """A thread-safe count of new requests not yet dispatched, bounded by ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._count = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        """Take one place; raises :class:`Overloaded` when all are taken."""
        with self._lock:
            if self._count >= self.capacity:
                raise Overloaded(f"fleet overloaded: {self._count} requests already waiting for a group "
                                 f"(scheduler.max_waiting_requests={self.capacity}); retry later")
            self._count += 1

    def release(self) -> None:
        with self._lock:
            self._count -= 1


@dataclass
class GroupLoad:
    """A group's load as the router weighs it (a snapshot, updated as requests are assigned)."""

    group_id: str
    role: str
    ready: bool
    free_pages: int
    running: int  # requests in the group's engine
    max_running: int
    outstanding_tokens: int  # prefill tokens still to compute + decode tokens still to generate
    max_model_len: int


class Router:
    """Chooses groups for requests; see the module docstring for the policy."""

    def __init__(self, page_size: int, max_waiting_requests: int) -> None:
        self.page_size = page_size
        self.gate = AdmissionGate(max_waiting_requests)
        self.queue: deque[FleetRequest] = deque()
        self.handoffs: deque[FleetRequest] = deque()

    def pages(self, num_tokens: int) -> int:
        """KV pages that ``num_tokens`` tokens take."""
        return -(-num_tokens // self.page_size)

    def _fits(self, load: GroupLoad, num_kv_tokens: int) -> bool:
        return (load.ready and load.running < load.max_running
                and load.free_pages - self.pages(num_kv_tokens) >= load.running)

    def pick_prefill(self, loads: Iterable[GroupLoad], request: FleetRequest) -> GroupLoad | None:
        """The prefill (or colocated) group to prefill ``request`` on now, or None to keep it queued."""
        fits = [g for g in loads if g.role in ("prefill", "colocated") and self._fits(g, request.num_tokens)]
        return min(fits, key=lambda g: (g.outstanding_tokens, g.running, g.group_id), default=None)

    def pick_decode(self, loads: Iterable[GroupLoad], request: FleetRequest) -> GroupLoad | None:
        """The decode group to receive ``request``'s KV now, or None to let it wait."""
        fits = [g for g in loads if g.role == "decode" and self._fits(g, request.num_tokens - 1)]
        return min(fits, key=lambda g: (g.outstanding_tokens, g.running, g.group_id), default=None)

    def assign(self, load: GroupLoad, request: FleetRequest, num_kv_tokens: int, tokens: int) -> None:
        """Account ``request`` (``num_kv_tokens`` of KV, ``tokens`` of work) to ``load``."""
        load.running += 1
        load.free_pages -= self.pages(num_kv_tokens)
        load.outstanding_tokens += tokens
