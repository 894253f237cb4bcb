"""Request routing: a bounded admission queue, and the choice of prefill and decode group per request.

The router holds two FIFO queues, both owned by the fleet's loop thread: ``queue`` (requests
waiting for a prefill-capable group: new ones, and ones moved off a failed group) and
``handoffs`` (prefilled requests whose KV waits for a decode group). A group is chosen as late
as possible, when it can take the request now: among ready groups with room for another running request and
enough free KV pages (keeping one page of headroom per running request, as the scheduler does),
the one with the fewest outstanding tokens. The decode group is chosen at hand-off time, not at
admission, so it reflects the decode load when the KV is ready.

Outstanding tokens count the work a group will do, not the tokens it holds: a request placed on a
prefill-capable group adds the prompt tokens that group will compute (:meth:`Router.prefill_work`:
its prompt less the prefix tokens the group's affinity table matches, at least 1) plus, on a
colocated group, its decode tokens. The fleet counts that against the group until the group's engine
reports having applied the placement; the engine then counts the request the same while it waits
(the placement carries the expected prefix, ``Admit.expected_cached_tokens``) and by what it really
computes once admitted, so the load does not jump when the report replaces the fleet's count, and it
is zero once the group's requests are done.

Prefix-aware routing (``cluster.routing: prefix_aware``, the default; it matters with more than one
prefill-capable group): among the groups that can take the request now, the one whose
:class:`fleet.prefix_affinity.PrefixAffinity` table matches most of the request's leading page keys
(its first ``cluster.routing_prefix_pages`` full pages) gets it, unless that group's outstanding
tokens exceed the least-loaded group's by more than ``cluster.routing_imbalance_tokens``: then the
least-loaded group does (ties in the match go to the less loaded). Since prefix hits are not
outstanding work, a burst of requests sharing a cached prefix stays on its group until the tokens
they leave it to compute, not their prompts, outweigh the bound. A prefix no group matches goes to
the least-loaded group, among equally loaded ones the one caching fewest pages (so distinct prefixes
spread over idle groups, as SGLang's router sends them to its smallest tree).
A cache hit saves its group the prefix's prefill; the bound keeps a popular prefix from piling every
request onto one group while others idle (SGLang's cache-aware router and Ray Serve LLM's
prefix-aware router fall back to load balancing on imbalance the same way). Every placement on a
prefill-capable group records the request's keys in that group's table.

Backpressure: only new requests count against ``scheduler.max_waiting_requests`` (checked in the caller's
thread by :class:`AdmissionGate`); a request already accepted is never refused later.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from fleet.prefix_affinity import PrefixAffinity
from fleet.request import FleetRequest
from worker.prefix_hash import PageKey, page_keys

RoutingPolicy = Literal["prefix_aware", "least_loaded"]


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
    outstanding_tokens: int  # prefill tokens still to compute (prefix hits left out) + decode tokens to generate
    max_model_len: int
    usable_pages: int = 1 << 30  # the group's KV pages (bounds its prefix-affinity table)


class Router:
    """Chooses groups for requests; see the module docstring for the policy."""

    def __init__(self, page_size: int, max_waiting_requests: int, policy: RoutingPolicy = "prefix_aware",
                 imbalance_tokens: int = 8192, prefix_pages: int = 128) -> None:
        self.page_size = page_size
        self.gate = AdmissionGate(max_waiting_requests)
        self.queue: deque[FleetRequest] = deque()
        self.handoffs: deque[FleetRequest] = deque()
        self.policy = policy
        self.imbalance_tokens = imbalance_tokens
        self.prefix_pages = prefix_pages
        self.affinity = PrefixAffinity()
        self.prefix_routed = 0  # placements that went to the best-matching group over the least loaded

    def page_keys(self, request: FleetRequest) -> list[PageKey]:
        """The keys of ``request``'s first ``prefix_pages`` full prompt pages (computed once per request)."""
        if request.prefix_keys is None:
            request.prefix_keys = page_keys(request.prompt_ids, self.page_size, limit=self.prefix_pages)
        return request.prefix_keys

    def pages(self, num_tokens: int) -> int:
        """KV pages that ``num_tokens`` tokens take."""
        return -(-num_tokens // self.page_size)

    def _fits(self, load: GroupLoad, num_kv_tokens: int) -> bool:
        return (load.ready and load.running < load.max_running
                and load.free_pages - self.pages(num_kv_tokens) >= load.running)

    def pick_prefill(self, loads: Iterable[GroupLoad], request: FleetRequest) -> GroupLoad | None:
        """The prefill (or colocated) group to prefill ``request`` on now, or None to keep it queued."""
        fits = [g for g in loads if g.role in ("prefill", "colocated") and self._fits(g, request.num_tokens)]
        least = min(fits, key=_least_loaded, default=None)
        if self.policy != "prefix_aware" or len(fits) < 2:
            return least
        keys = self.page_keys(request)
        matches = {g.group_id: self.affinity.match(g.group_id, keys) for g in fits}
        best = min(fits, key=lambda g: (-matches[g.group_id], *_least_loaded(g)))
        if matches[best.group_id] == 0:  # a new prefix: among the least loaded, the group caching least
            return min(fits, key=lambda g: (*_least_loaded(g)[:2], self.affinity.size(g.group_id), g.group_id))
        if best.outstanding_tokens - least.outstanding_tokens > self.imbalance_tokens:
            return least
        if best is not least:
            self.prefix_routed += 1
        return best

    def prefill_work(self, load: GroupLoad, request: FleetRequest) -> tuple[int, int]:
        """``(cached, tokens)`` for placing ``request`` on ``load``'s prefill-capable group: the prefix
        tokens its table matches (matched leading pages x page size; 0 under least_loaded or for a
        request asking for prompt log-probabilities, which computes its whole prompt), and the
        outstanding tokens the placement adds: ``max(1, num_tokens - cached)`` to compute, plus the
        decode tokens to generate on a colocated group. Asked before :meth:`assign` records the keys."""
        cached = 0
        if self.policy == "prefix_aware" and request.params.prompt_logprobs is None:
            cached = self.affinity.match(load.group_id, self.page_keys(request)) * self.page_size
        tokens = max(1, request.num_tokens - cached)  # the engine counts a waiting request alike
        if load.role == "colocated":
            tokens += request.remaining_output(load.max_model_len)
        return cached, tokens

    def pick_decode(self, loads: Iterable[GroupLoad], request: FleetRequest) -> GroupLoad | None:
        """The decode group to receive ``request``'s KV now, or None to let it wait."""
        fits = [g for g in loads if g.role == "decode" and self._fits(g, request.num_tokens - 1)]
        return min(fits, key=_least_loaded, default=None)

    def assign(self, load: GroupLoad, request: FleetRequest, num_kv_tokens: int, tokens: int) -> None:
        """Account ``request`` (``num_kv_tokens`` of KV, ``tokens`` of work) to ``load``."""
        load.running += 1
        load.free_pages -= self.pages(num_kv_tokens)
        load.outstanding_tokens += tokens
        if load.role in ("prefill", "colocated") and self.policy == "prefix_aware":
            self.affinity.record(load.group_id, self.page_keys(request), load.usable_pages)

    def forget_group(self, group_id: str) -> None:
        """``group_id`` died or restarted: whatever it cached is gone."""
        self.affinity.forget(group_id)


def _least_loaded(load: GroupLoad) -> tuple:
    return load.outstanding_tokens, load.running, load.group_id
