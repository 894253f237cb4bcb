"""The fleet's loop: the one thread that steps every group's engine and moves requests between them.

Engines are not thread-safe, so everything that touches an engine, the router's queues or a
:class:`FleetRequest` runs here; clients talk to the loop through a command queue and read
events from per-request queues. One iteration:

1. apply client commands (submit, abort);
2. watch the groups: the requests of a disaggregated group that is no longer ready are moved
   back to the router (their KV is gone with the group) and re-prefilled elsewhere, or where
   their group restarts; requests that need a role whose every group is lost end with an error;
3. end requests past their deadline;
4. dispatch queued requests to prefill (or colocated) groups, and prefilled requests' KV to
   decode groups (the KV import blocks the loop for the transfer);
5. step every ready engine that has work once, and deliver the events.

A group that is not ready is never stepped (its executor would block waiting for the restart).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from cluster.config import ClusterConfig
from cluster.fleet_config import FleetConfig
from cluster.fleet_request import FleetRequest, Wakeups
from cluster.kv_transport import KVTransferFailed, KVTransport
from cluster.rank import GroupState
from cluster.router import GroupLoad, Router
from worker.engine import Engine
from worker.outputs import FailureKind, RequestEvent
from worker.request import Request, RequestRejected

log = logging.getLogger(__name__)


class FleetMember:
    """One group of the fleet: its worker group, its engine and its role."""

    def __init__(self, group_id: str, role: str, group, engine: Engine) -> None:
        self.group_id, self.role, self.group, self.engine = group_id, role, group, engine
        self.dead_since: float | None = None

    @property
    def ready(self) -> bool:
        return self.group.state is GroupState.READY

    def observe(self, now: float) -> None:
        self.dead_since = (self.dead_since or now) if self.group.state is GroupState.DEAD else None

    def lost(self, now: float, lost_after_s: float) -> bool:
        """Dead and not coming back: restart is off, or it stayed dead past ``lost_after_s``."""
        if self.group.state is not GroupState.DEAD:
            return False
        return not self.group.config.cluster.restart or (self.dead_since is not None
                                                          and now - self.dead_since > lost_after_s)

    def health_state(self, now: float, lost_after_s: float) -> str:
        state = self.group.state
        if state is GroupState.READY:
            return "ready"
        if self.lost(now, lost_after_s):
            return "dead"
        if self.group.restarts == 0:
            return state.value  # first start: starting | capturing
        return "degraded"  # dead or restarting after a failure

    def unfinished(self) -> list[Request]:
        s = self.engine.scheduler
        return sorted(list(s.running) + list(s.waiting), key=lambda r: r.arrival)

    def load(self) -> GroupLoad:
        e = self.engine
        reqs = self.unfinished()
        prefill = sum(r.num_tokens - r.num_computed for r in reqs if r.prefilling)
        decode = sum(max(0, min(r.params.max_tokens - len(r.output_ids), e.max_model_len - r.num_tokens))
                     for r in reqs) if self.role != "prefill" else 0
        return GroupLoad(self.group_id, self.role, self.ready, e.num_free_pages, len(reqs),
                         e.config.scheduler.max_running_requests, prefill + decode, e.max_model_len)


class FleetLoop:
    """State and steps of the loop thread (see the module docstring)."""

    def __init__(self, cluster: ClusterConfig, fleet_config: FleetConfig, members: list[FleetMember], router: Router,
                 transport: KVTransport | None, on_done) -> None:
        self.cluster, self.fleet_config = cluster, fleet_config
        self.disaggregated = cluster.mode == "disaggregated"
        self.members, self.router, self.transport = members, router, transport
        self.on_done = on_done  # called with the request id when a request ends (any thread-side cleanup)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[str, FleetRequest] = {}
        self.max_model_len = min(s.engine.max_model_len for s in members)
        self.handoff_limit = sum(s.engine.config.scheduler.max_running_requests for s in members if s.role == "decode")
        self.finished = 0
        self.failed = 0
        self.health: dict = {}
        self.health_lock = threading.Lock()
        self.wakeups = Wakeups()  # the sinks of requests submitted to this loop defer their wake-ups here

    # ----- the loop -----

    def run(self, stop: threading.Event) -> None:
        """Iterate until ``stop`` is set; then (or on a crash) end every request with an error."""
        why = "fleet is shutting down"
        try:
            while not stop.is_set():
                if not self.run_once():
                    self._wait_for_command(self.fleet_config.idle_poll_s)
        except BaseException as e:
            why = f"fleet loop crashed: {type(e).__name__}: {e}"
            raise
        finally:
            self._drain()
            for fr in list(self.requests.values()):
                self._fail(fr, FailureKind.FLEET_STOPPED, why)

    def run_once(self) -> bool:
        """One iteration; returns whether any engine stepped. Readers are woken once per group
        step and at the end of the iteration (``wakeups``), not once per event."""
        now = time.monotonic()
        with self.wakeups.deferred():
            self._drain()
            self._watch_groups(now)
            self._expire(now)
            self._dispatch_prefill()
            self._dispatch_handoffs()
            stepped = self._step_all()
        self.publish(now)
        return stepped

    def _wait_for_command(self, timeout_s: float) -> None:
        try:
            self._apply(self.commands.get(timeout=timeout_s))
        except queue.Empty:
            pass

    def _drain(self) -> None:
        while True:
            try:
                self._apply(self.commands.get_nowait())
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind, arg = command
        if kind == "submit":
            self.requests[arg.request_id] = arg
            self.router.queue.append(arg)
        elif kind == "abort":
            request_id, error = arg
            fr = self.requests.get(request_id)
            if fr is not None:
                self._end(fr, "abort", error)

    # ----- ending and moving requests -----

    def _detach(self, fr: FleetRequest) -> None:
        """Take ``fr`` out of wherever it is (freeing its pages there)."""
        member = fr.member
        if member is not None:
            member.engine.abort(fr.request_id)
            member.engine.release(fr.request_id)
            fr.member = None
        fr.payload = None
        for q in (self.router.queue, self.router.handoffs):
            if fr in q:
                q.remove(fr)
        if fr.holds_admission:
            fr.holds_admission = False
            self.router.gate.release()

    def _end(self, fr: FleetRequest, reason: str, error: str | None = None, event: RequestEvent | None = None,
             failure: FailureKind | None = None) -> None:
        self._detach(fr)
        self.requests.pop(fr.request_id, None)
        if reason == "error":
            self.failed += 1
            log.warning("request %s ended with an error (%s): %s", fr.request_id, failure, error)
        else:
            self.finished += 1
        fr.finish(reason, error, event, failure)
        self.on_done(fr.request_id)

    def _fail(self, fr: FleetRequest, failure: FailureKind, error: str, event: RequestEvent | None = None) -> None:
        """End ``fr`` with finish_reason "error": ``error`` says why, ``failure`` what kind of failure it is."""
        self._end(fr, "error", error, event, failure)

    def _requeue(self, fr: FleetRequest, why: str) -> None:
        """Send ``fr`` back to prefill (its KV is gone), unless it has used up its attempts."""
        self._detach(fr)
        fr.moves += 1
        fr.last_failure = why
        if fr.attempts >= self.cluster.max_attempts:
            self._fail(fr, FailureKind.GAVE_UP, f"request failed {fr.attempts} times and was given up "
                                                f"(cluster.max_attempts={self.cluster.max_attempts}); "
                                                f"last failure: {why}")
        else:
            self.router.queue.appendleft(fr)

    # ----- groups -----

    def _watch_groups(self, now: float) -> None:
        for member in self.members:
            member.observe(now)
            if member.ready:
                continue
            moved = [self.requests[r.request_id] for r in member.unfinished() if r.request_id in self.requests]
            if member.role != "colocated":
                # The KV of every request in this group went with it: re-prefill them (oldest first).
                why = f"group {member.group_id} failed: {member.group.last_error}"
                for fr in reversed(moved):
                    self._requeue(fr, why)
                if moved:
                    log.warning("%d requests moved off %s (%s)", len(moved), member.group_id, why)
            elif member.lost(now, self.cluster.lost_after_s):
                for fr in moved:
                    self._fail(fr, FailureKind.GROUP_FAILED,
                               f"group {member.group_id} is dead and not restarting: {member.group.last_error}")
        self._fail_unservable(now)

    def _role_lost(self, role: str, now: float) -> str | None:
        """Why no group of ``role`` can serve again (None while one is ready or restarting)."""
        members = [s for s in self.members if s.role == role]
        if not members or not all(s.lost(now, self.cluster.lost_after_s) for s in members):
            return None
        return f"no {role} group is available: " + "; ".join(
            f"{s.group_id} is dead ({s.group.last_error})" for s in members)

    def _fail_unservable(self, now: float) -> None:
        first = "prefill" if self.disaggregated else "colocated"
        queued = self._role_lost(first, now) or (self._role_lost("decode", now) if self.disaggregated else None)
        for fr in list(self.router.queue) if queued else ():
            self._fail(fr, FailureKind.GROUP_FAILED, queued)
        waiting = self._role_lost("decode", now) if self.disaggregated else None
        for fr in list(self.router.handoffs) if waiting else ():
            self._fail(fr, FailureKind.GROUP_FAILED, waiting)

    def _expire(self, now: float) -> None:
        for fr in list(self.requests.values()):
            deadline = fr.deadline
            if deadline is not None and now > deadline:
                self._fail(fr, FailureKind.DEADLINE, f"deadline exceeded: not finished {fr.timeout_s:g}s after "
                                                     f"submission ({len(fr.output_ids)} tokens generated)")

    # ----- dispatch -----

    def _dispatch_prefill(self) -> None:
        if len(self.router.handoffs) >= max(1, self.handoff_limit):
            return
        self._dispatch(self.router.queue, ("prefill", "colocated"), self.router.pick_prefill, self._prefill)

    def _dispatch_handoffs(self) -> None:
        self._dispatch(self.router.handoffs, ("decode",), self.router.pick_decode, self._hand_off)

    def _dispatch(self, waiting: deque[FleetRequest], roles: tuple[str, ...],
                  pick: Callable[[list[GroupLoad], FleetRequest], GroupLoad | None],
                  place: Callable[[FleetMember, GroupLoad, FleetRequest], None]) -> None:
        """Hand ``waiting`` requests, oldest first, to the group of ``roles`` that ``pick`` chooses,
        until it chooses none; ``place`` puts each in its group's engine (or ends or requeues it)."""
        if not waiting:
            return
        members = {s.group_id: s for s in self.members if s.role in roles}
        loads = [s.load() for s in members.values()]
        while waiting:
            fr = waiting[0]
            load = pick(loads, fr)
            if load is None:
                return
            waiting.popleft()
            place(members[load.group_id], load, fr)

    def _prefill(self, member: FleetMember, load: GroupLoad, fr: FleetRequest) -> None:
        export = functools.partial(self._export, member, fr) if member.role == "prefill" else None
        try:
            member.engine.admit(fr.prompt_ids, fr.params, seed=fr.seed, request_id=fr.request_id,
                                output_ids=fr.output_ids, logprobs=fr.logprobs, on_first_token=export)
        except RequestRejected as e:
            self._fail(fr, FailureKind.REJECTED, f"rejected by group {member.group_id}: {e}")
            return
        fr.member = member
        fr.attempts += 1
        if fr.holds_admission:
            fr.holds_admission = False
            self.router.gate.release()
        self.router.assign(load, fr, fr.num_tokens, fr.num_tokens)

    def _export(self, member: FleetMember, fr: FleetRequest, req: Request) -> None:
        # Runs inside the prefill engine's step, before the request's pages are freed; must not raise.
        try:
            fr.payload = self.transport.export_kv(member.group, list(req.pages), req.num_computed)
        except Exception as e:  # noqa: BLE001 (any failure means: re-prefill this request)
            fr.payload = None
            fr.last_failure = f"KV export from {member.group_id} failed: {e}"

    def _hand_off(self, member: FleetMember, load: GroupLoad, fr: FleetRequest) -> None:
        payload, fr.payload = fr.payload, None
        import_kv = functools.partial(self._import, member, payload)
        try:
            member.engine.add_prefilled_request(fr.prompt_ids, fr.output_ids, fr.params, seed=fr.seed,
                                                request_id=fr.request_id, logprobs=fr.logprobs, import_kv=import_kv)
        except KVTransferFailed as e:
            # A timed-out import's late writes could land in pages the group reuses; a rank that died
            # during it leaves a group no step has seen fail yet, so every hand-off to it would fail.
            dead = [] if e.timed_out else member.group.dead_ranks()
            if e.timed_out or dead:
                member.group.fail(str(e) if e.timed_out else f"a rank died: rank {', '.join(map(str, dead))} ({e})")
            self._requeue(fr, str(e))
            return
        except RequestRejected as e:
            self._fail(fr, FailureKind.REJECTED, f"rejected by group {member.group_id}: {e}")
            return
        fr.member = member
        self.router.assign(load, fr, fr.num_tokens - 1, fr.remaining_output(load.max_model_len))

    def _import(self, member: FleetMember, payload, pages: list[int]) -> int:
        return self.transport.import_kv(member.group, pages, payload, self.cluster.handoff_timeout_s)

    # ----- stepping -----

    def _step_all(self) -> bool:
        stepped = False
        for member in self.members:
            if not member.ready or not member.engine.has_unfinished():
                continue
            before = len(member.engine.step_stats)
            events = member.engine.step()
            stepped = stepped or bool(events) or len(member.engine.step_stats) != before or member.engine.in_flight
            for ev in events:
                self._on_event(member, ev)
            self.wakeups.flush()  # this group's tokens go out before the next group steps
        return stepped

    def _on_event(self, member: FleetMember, ev: RequestEvent) -> None:
        fr = self.requests.get(ev.request_id)
        if fr is None:  # ended meanwhile (cannot happen: ends detach from the engine first)
            member.engine.release(ev.request_id)
            return
        if ev.finish_reason == "handoff":
            member.engine.release(ev.request_id)
            fr.member = None
            fr.deliver(RequestEvent(ev.request_id, ev.token_ids, ev.text, False, None, ev.logprobs))
            if fr.payload is None:
                self._requeue(fr, fr.last_failure or f"KV export from {member.group_id} failed")
            else:
                self.router.handoffs.append(fr)
        elif ev.finished:
            # An engine ends a request with "error" only when its executor is gone (GroupUnavailable).
            failed = ev.finish_reason == "error"
            error = member.engine.errors.get(ev.request_id) if failed else None
            failure = FailureKind.GROUP_FAILED if failed else None
            member.engine.release(ev.request_id)
            fr.member = None
            final = RequestEvent(ev.request_id, ev.token_ids, ev.text, True, ev.finish_reason, ev.logprobs, error,
                                 failure)
            self._end(fr, ev.finish_reason, error, final, failure)
        else:
            fr.deliver(ev)

    # ----- health -----

    def publish(self, now: float) -> None:
        """Rebuild the health snapshot (``health``, under ``health_lock``) as of ``now``."""
        groups = {}
        for s in self.members:
            g = s.group
            groups[s.group_id] = {
                "role": s.role, "state": s.health_state(now, self.cluster.lost_after_s), "phase": g.state.value,
                "tp_size": g.config.cluster.tp_size, "generation": g.health()["generation"], "restarts": g.restarts,
                "last_error": g.last_error, "num_pages": s.engine.allocator.num_usable,
                "free_pages": s.engine.num_free_pages, "requests": len(s.unfinished()),
                "waiting": g.waiting.health(now) if g.waiting is not None else None,
            }
        states = {v["state"] for v in groups.values()}
        roles_lost = any(self._role_lost(r, now) for r in {s.role for s in self.members})
        status = "dead" if roles_lost else "ready" if states == {"ready"} else \
            "starting" if states <= {"ready", "starting", "capturing"} else "degraded"
        snapshot = {"status": status, "mode": self.cluster.mode, "groups": groups,
                    "queued": len(self.router.queue), "handoffs": len(self.router.handoffs),
                    "in_flight": len(self.requests), "finished": self.finished, "failed": self.failed}
        with self.health_lock:
            self.health = snapshot
