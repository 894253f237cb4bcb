"""The fleet's Python API: prefill, decode (or colocated) worker groups behind one request interface.

>>> fleet = Fleet.start(config, mode="disaggregated", num_decode_groups=2)   # doctest: +SKIP
>>> outputs = fleet.generate(["Hello"], SamplingParams(max_tokens=16))       # doctest: +SKIP
>>> for event in fleet.stream("Hello"): print(event.text, end="")            # doctest: +SKIP
>>> fleet.shutdown()                                                          # doctest: +SKIP

Each group is a :class:`cluster.fleet_group.FleetWorkerGroup` whose leader rank runs the group's
own :class:`worker.engine.Engine` (:mod:`cluster.engine_host`); one background thread
(:mod:`fleet.loop`) routes requests (:mod:`fleet.router`) and moves them between groups,
exchanging one command batch and one report per group per iteration at most. Client calls are
thread-safe: they validate and enqueue in the caller's thread and read events from a per-request queue.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import ray

from cluster.config import GroupConfig
from cluster.fleet_group import FleetWorkerGroup
from cluster.kv_transport import create_transport
from cluster.rank import GroupState, GroupUnavailable, PlacementWait
from cluster.threads import name_os_thread
from fleet.config import FleetConfig, apply_fleet_options, group_layout, role_config
from fleet.handle import FleetClosed, FleetLink, RequestHandle
from fleet.loop import FleetLoop
from fleet.member import FleetMember
from fleet.metrics import gather_rank_metrics
from fleet.replans import PendingReplan
from fleet.request import EventSink, FleetRequest
from fleet.router import Overloaded, Router
from worker.admission import PromptLimits, encode_prompt
from worker.outputs import RequestEvent, RequestOutput
from worker.request import RequestRejected
from worker.sampling.params import SamplingParams
from worker.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

__all__ = ["DrainReport", "Fleet", "FleetClosed", "FleetDraining", "Overloaded", "RequestHandle"]

#: Seconds :meth:`Fleet.drain` waits for the requests it aborted to end before it shuts the fleet down.
DRAIN_ABORT_WAIT_S = 5.0


class FleetDraining(FleetClosed):
    """The fleet is draining (:meth:`Fleet.drain`): it finishes what it has and accepts no new request."""


@dataclass(frozen=True)
class DrainReport:
    """What :meth:`Fleet.drain` did: requests in flight that finished on their own, requests it ended
    with finish_reason "abort" at the timeout, and how long the drain took (shutdown included)."""

    finished: int
    aborted: int
    seconds: float


class Fleet:
    """Disaggregated (or colocated) serving over Ray worker groups; build with :meth:`start`."""

    def __init__(self, config: GroupConfig, fleet_config: FleetConfig, members: list[FleetMember], transport,
                 tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.config, self.fleet_config, self.members = config, fleet_config, members
        self.tokenizer = tokenizer
        c = config.cluster
        self.router = Router(config.cache.page_size, config.scheduler.max_waiting_requests, c.routing,
                             c.routing_imbalance_tokens, c.routing_prefix_pages)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever a request ends
        self._live: set[str] = set()
        self._ids = itertools.count()
        self._rng = random.Random(config.model.seed)
        self._closed = False
        self._draining = False
        self._loop = FleetLoop(config.cluster, fleet_config, members, self.router, transport, self._done,
                               max_model_len)
        self.max_model_len = max_model_len
        self.prompt_limits = PromptLimits(members[0].group.arch.vocab_size, self.max_model_len)
        self._stop = threading.Event()
        self._loop.publish(time.monotonic())
        self._thread = threading.Thread(target=self._run, name="graphfleet-loop", daemon=True)
        self._crash: str | None = None
        self._link = FleetLink(self._thread.is_alive, self._stopped_why, self.abort)
        self._thread.start()
        for member in members:
            member.client.start()

    # ----- lifecycle -----

    @classmethod
    def start(cls, config: GroupConfig,
              on_group_state: Callable[[str, GroupState, PlacementWait | None], None] | None = None,
              tokenizer: Tokenizer | None = None, cancel: threading.Event | None = None, **fleet_options) -> Fleet:
        """Start every group of the fleet (concurrently) and its loop.

        ``fleet_options`` are :class:`FleetConfig` fields and overrides of ``config``'s cluster keys
        and ``max_waiting_requests`` (see :func:`fleet.config.apply_fleet_options`).
        ``on_group_state(group_id, state, waiting)`` hears every group's lifecycle changes (start-up
        phases included) and, about every second while a group waits for resources, its
        :class:`cluster.rank.PlacementWait` (else None), from the thread making them. ``tokenizer`` is
        the checkpoint's when the caller has loaded it already (the Serve replica's); None loads it
        (if the checkpoint has one): the fleet encodes text prompts with it; each group's leader loads its
        own to detokenize. Setting ``cancel`` ends
        the start (and, later, any group restart) at its next look (see :class:`cluster.group.WorkerGroup`).

        Raises ``ConfigError`` for bad options, ``KVTransportUnavailable`` for a transport this build
        lacks, ``GroupUnavailable`` if a group fails to start (the others are shut down).
        """
        if not ray.is_initialized():
            raise RuntimeError("ray is not initialized: call ray.init(...) before Fleet.start")
        config, fcfg = apply_fleet_options(config, **fleet_options)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.path)
        disaggregated = config.cluster.mode == "disaggregated"
        transport = create_transport(config.cluster.kv_transport) if disaggregated else None
        layout = group_layout(config.cluster, fcfg.name)
        configs = {gid: role_config(config, role) for gid, role in layout}
        groups: dict[str, FleetWorkerGroup] = {}
        errors: list[str] = []
        with ThreadPoolExecutor(len(layout), thread_name_prefix="fleet-start") as pool:
            futures = {gid: pool.submit(FleetWorkerGroup, configs[gid], gid, role, on_group_state, cancel)
                       for gid, role in layout}
            for gid, fut in futures.items():
                try:
                    groups[gid] = fut.result()
                except Exception as e:  # noqa: BLE001 (reported together below)
                    errors.append(f"{gid}: {e}")
        try:
            if errors:
                raise GroupUnavailable("fleet start failed: " + "; ".join(errors))
            if disaggregated:
                prefill = [groups[g] for g, r in layout if r == "prefill"]
                decode = [groups[g] for g, r in layout if r == "decode"]
                _check_kv_layouts(prefill, decode, config.cluster.start_timeout_s)
                transport.check(prefill, decode, config.cluster.start_timeout_s)
            # Every engine stops sequences at the fleet's shortest limit, so where a request runs
            # (and where it moves after a failure) never changes where it ends.
            max_len = min(g.max_len for g in groups.values())
            with ThreadPoolExecutor(len(layout), thread_name_prefix="fleet-engines") as pool:
                list(pool.map(lambda g: g.host_engine(max_len), groups.values()))
            members = [FleetMember(gid, role, groups[gid]) for gid, role in layout]
        except BaseException:
            _shutdown_groups(list(groups.values()))
            raise
        log.info("fleet %s ready: %s", fcfg.name, ", ".join(f"{gid} ({role})" for gid, role in layout))
        return cls(config, fcfg, members, transport, tokenizer, max_len)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """End every request with an error, stop the loop and shut every group down (idempotent)."""
        with self._lock:
            self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        for member in self.members:
            member.client.close()
        _shutdown_groups([s.group for s in self.members])

    def drain(self, timeout_s: float) -> DrainReport:
        """Shut down gracefully: stop admitting (:meth:`submit` raises :class:`FleetDraining`), let the
        requests in flight finish for up to ``timeout_s``, end the rest with finish_reason "abort" and an
        ``error`` saying the server is shutting down, then :meth:`shutdown` (every rank actor and placement
        group released). Every wait is bounded: ``timeout_s``, then ``DRAIN_ABORT_WAIT_S`` for the aborted
        ones, then the shutdown's. A second call (or one after :meth:`shutdown`) has nothing left to do.
        """
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
        started = time.monotonic()
        with self._lock:
            if self._draining or self._closed:
                return DrainReport(0, 0, 0.0)
            self._draining = True
            in_flight = len(self._live)
        log.info("fleet %s draining: %d requests in flight, %gs to finish", self.fleet_config.name, in_flight,
                 timeout_s)
        self._wait_idle(timeout_s)
        with self._lock:
            left = sorted(self._live)
        why = (f"the server is shutting down: the request did not finish within the drain timeout "
               f"({timeout_s:g}s)")
        for rid in left:
            self._loop.commands.put(("abort", (rid, why)))
        if left:
            self._wait_idle(DRAIN_ABORT_WAIT_S)
        self.shutdown()
        report = DrainReport(in_flight - len(left), len(left), time.monotonic() - started)
        log.info("fleet %s drained in %.1fs: %d finished, %d aborted; its groups are shut down",
                 self.fleet_config.name, report.seconds, report.finished, report.aborted)
        return report

    def _wait_idle(self, timeout_s: float) -> None:
        """Wait until no request is live, the loop has stopped, or ``timeout_s`` has passed."""
        end = time.monotonic() + timeout_s
        with self._lock:
            while self._live and self._thread.is_alive() and (left := end - time.monotonic()) > 0:
                self._idle.wait(min(left, 0.5))

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` has begun (the fleet accepts no new request)."""
        return self._draining

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _run(self) -> None:
        name_os_thread(self._thread.name)
        try:
            self._loop.run(self._stop)
        except BaseException as e:
            self._crash = f"{type(e).__name__}: {e}"
            log.exception("fleet loop crashed")
            raise

    def _stopped_why(self) -> str:
        return self._crash or ("shut down" if self._closed else "loop not running")

    def _done(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)
            self._idle.notify_all()

    # ----- requests -----

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, timeout_s: float | None = None) -> RequestHandle:
        """Queue a request and return its handle.

        ``timeout_s`` is the request's deadline from now (None: no deadline): past it the request
        ends with finish_reason "error" and a message saying so. Raises
        :class:`RequestRejected` (bad prompt or id), :class:`Overloaded` (queue full), :class:`FleetDraining`
        (draining), :class:`FleetClosed` (shut down).
        """
        params = params or SamplingParams()
        ids = encode_prompt(prompt, self.tokenizer)
        self.prompt_limits.check(ids)
        self.prompt_limits.check_params(params)
        if timeout_s is not None and not timeout_s > 0:
            raise RequestRejected(f"timeout_s must be > 0, got {timeout_s!r}")
        with self._lock:
            if self._draining and not self._closed:
                raise FleetDraining("the fleet is draining (the server is shutting down): it accepts no new "
                                    "requests; retry on another replica")
            if self._closed or not self._thread.is_alive():
                raise FleetClosed(f"the fleet is not accepting requests ({self._stopped_why()})")
            rid = request_id if request_id is not None else f"fleet-{next(self._ids)}"
            if rid in self._live:
                raise RequestRejected(f"request id {rid!r} is already in use")
            self.router.gate.acquire()
            seed = params.effective_seed(self._rng)
            self._live.add(rid)
        request = FleetRequest(rid, ids, params, seed, timeout_s, sink=EventSink(self._loop.wakeups))
        self._loop.commands.put(("submit", request))
        return RequestHandle(self._link, request)

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """End ``request_id`` with finish_reason "abort", freeing its pages (or dropping its KV) wherever it
        is: queued, on a group, or waiting for a decode group; False if unknown. ``error``, when given,
        tells the client why (its final event's and output's ``error``): the server ended it."""
        with self._lock:
            if request_id not in self._live:
                return False
        self._loop.commands.put(("abort", (request_id, error)))
        return True

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 timeout_s: float | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion and return their outputs in order.

        A request that fails has finish_reason "error" and ``error`` set; ``timeout_s`` is each
        request's deadline. Raises :class:`Overloaded` if the queue cannot take them all (the
        ones already queued are aborted).
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        handles: list[RequestHandle] = []
        try:
            for p, sp in zip(prompts, params):
                handles.append(self.submit(p, sp, timeout_s=timeout_s))
            return [h.result() for h in handles]
        finally:
            for h in handles:
                if not h.finished:
                    h.abort()

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, timeout_s: float | None = None,
               wait_s: float | None = None) -> Iterator[RequestEvent]:
        """Submit now (so ``Overloaded`` raises here) and return an iterator of the request's events.

        The last event has ``finished``; closing the iterator early aborts the request.
        ``timeout_s`` is the request's deadline, ``wait_s`` bounds each wait for an event.
        """
        return _events(self.submit(prompt, params, request_id=request_id, timeout_s=timeout_s), wait_s)

    def astream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                request_id: str | None = None, timeout_s: float | None = None) -> AsyncIterator[RequestEvent]:
        """:meth:`stream` for asyncio: events are awaited on the caller's loop, never blocking it."""
        return _aevents(self.submit(prompt, params, request_id=request_id, timeout_s=timeout_s))

    # ----- graphs -----

    def replan(self, timeout_s: float | None = 600.0) -> dict[str, dict]:
        """Re-plan every ready group's CUDA-graph ladders from the batches it has run, live.

        Each group's engine reads back its step in flight, every rank of the group captures the new
        ladders beside the old graphs (within the graph budget), swaps and releases the old, and the
        group steps on; requests on it pause for the capture and continue token for token. Returns
        per group the :class:`graphs.budget.ReplanSummary` as a dict (ladders before and after,
        resident and budget bytes, seconds, padding per step before and after) or ``{"error": why}``
        (refused for want of budget, not ready, failed meanwhile). Raises :class:`FleetClosed` when
        the fleet is shut down, ``TimeoutError`` past ``timeout_s``.
        """
        with self._lock:
            if self._closed or not self._thread.is_alive():
                raise FleetClosed(f"the fleet is not running ({self._stopped_why()})")
        pending = PendingReplan(f"replan-{next(self._ids)}")
        self._loop.commands.put(("replan", pending))
        try:
            return pending.future.result(timeout_s)
        except FutureTimeout as e:
            raise TimeoutError(f"the re-plan did not finish within {timeout_s} s") from e

    # ----- observation -----

    def health(self) -> dict:
        """Fleet status (ready | starting | degraded | dead; draining, then stopped, once :meth:`drain` or
        :meth:`shutdown` has begun) and per group: role, state (starting, capturing, ready, degraded =
        restarting after a failure, dead = lost), pages, requests, the router's ``outstanding_tokens``
        and ``prefix_keys``, ``waiting`` (:meth:`cluster.rank.PlacementWait.health`) while its restart
        waits for resources; ``routing``: the policy and its placements that followed a prefix."""
        with self._loop.health_lock:
            snapshot = dict(self._loop.health)
        snapshot["groups"] = {k: dict(v) for k, v in snapshot.get("groups", {}).items()}
        if not self._thread.is_alive():
            snapshot["status"] = "stopped" if self._closed and self._crash is None else "dead"
            snapshot["error"] = self._stopped_why()
        elif self._draining:
            snapshot["status"] = "draining"
        return snapshot

    def rank_metrics(self, timeout_s: float = 1.0) -> list[bytes]:
        """The Prometheus text of every rank's registry (``cuda_graph_*`` labelled group, rank, role).

        Ranks that are dead, restarting or busy past ``timeout_s`` (all ranks share it) are left out.
        """
        return gather_rank_metrics([s.group for s in self.members], timeout_s)


def _events(handle: RequestHandle, wait_s: float | None) -> Iterator[RequestEvent]:
    try:
        yield from handle.events(wait_s)
    finally:
        if not handle.finished:
            handle.abort()


async def _aevents(handle: RequestHandle) -> AsyncIterator[RequestEvent]:
    try:
        async for event in handle.aevents():
            yield event
    finally:
        if not handle.finished:
            handle.abort()


def _check_kv_layouts(prefill: list[FleetWorkerGroup], decode: list[FleetWorkerGroup], timeout_s: float) -> None:
    """Rank i of every prefill group must be able to hand KV to rank i of every decode group."""
    layouts = {g.group_id: g.kv_layouts(timeout_s) for g in prefill + decode}
    for p in prefill:
        for d in decode:
            src, dst = layouts[p.group_id], layouts[d.group_id]
            if len(src) != len(dst):
                raise ValueError(f"KV hand-off {p.group_id} -> {d.group_id}: tp sizes {len(src)} and {len(dst)} "
                                 "differ (equal sizes are required)")
            for rank, (a, b) in enumerate(zip(src, dst)):
                why = a.mismatch(b)
                if why:
                    raise ValueError(f"KV hand-off {p.group_id} -> {d.group_id}: rank {rank} layouts differ: {why}")


def _shutdown_groups(groups: list[FleetWorkerGroup]) -> None:
    if not groups:
        return
    with ThreadPoolExecutor(len(groups), thread_name_prefix="fleet-stop") as pool:
        list(pool.map(lambda g: g.shutdown(), groups))
