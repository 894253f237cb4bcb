"""The fleet's loop: the one thread that routes requests to the groups' engines and moves them between groups.

Every group runs its own engine loop on its leader rank (:mod:`cluster.engine_host`); this loop
does routing, hand-offs and failure handling only. Everything that touches the router's queues
or a :class:`FleetRequest` runs here; clients talk to the loop through a command queue and read
events from per-request queues, and each group's receiver thread (:mod:`fleet.group_client`)
puts that group's reports and failures on the same queue. One iteration:

1. apply what is queued: client commands (submit, abort, replan), group reports (events, staged
   hand-offs, admitted or refused hand-offs, re-plans done, load) and group failures;
2. watch the groups: the requests of a group that is no longer ready (or whose generation is
   new) are moved back to the router (their KV is gone with the group) and re-prefilled
   elsewhere, or where their group restarts; requests that need a role whose every group is lost
   end with an error;
3. end requests past their deadline;
4. dispatch queued requests to prefill (or colocated) groups, and prefilled requests' KV to
   decode groups;
5. send each group the commands of this iteration as one batch.

The loop sleeps on its queue between iterations (until the next deadline, at most half a second).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from cluster.config import ClusterConfig
from cluster.group_messages import Abort, Admit, GroupReport, Prefilled
from cluster.kv_transport import KVTransferFailed, KVTransport
from cluster.rank import GroupState
from fleet.config import FleetConfig
from fleet.group_client import GroupClient
from fleet.member import FleetMember
from fleet.replans import Replans
from fleet.request import FleetRequest, Wakeups
from fleet.router import GroupLoad, Router
from worker.outputs import FailureKind, RequestEvent

log = logging.getLogger(__name__)


class FleetLoop:
    """State and steps of the loop thread (see the module docstring)."""

    def __init__(self, cluster: ClusterConfig, fleet_config: FleetConfig, members: list[FleetMember], router: Router,
                 transport: KVTransport | None, on_done, max_model_len: int) -> None:
        self.cluster, self.fleet_config = cluster, fleet_config
        self.disaggregated = cluster.mode == "disaggregated"
        self.members, self.router, self.transport = members, router, transport
        self.on_done = on_done  # called with the request id when a request ends (any thread-side cleanup)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        for member in members:
            member.client = GroupClient(member.group, self.commands.put)
        self.requests: dict[str, FleetRequest] = {}
        self.max_model_len = max_model_len
        self.handoff_limit = sum(s.group.config.scheduler.max_running_requests for s in members if s.role == "decode")
        self._placements = itertools.count(1)  # numbers each placement of a request on an engine
        self.finished = 0
        self.failed = 0
        self.health: dict = {}
        self.health_lock = threading.Lock()
        self.wakeups = Wakeups()  # the sinks of requests submitted to this loop defer their wake-ups here
        self.replans = Replans()

    # ----- the loop -----

    def run(self, stop: threading.Event) -> None:
        """Iterate until ``stop`` is set; then (or on a crash) end every request with an error."""
        why = "fleet is shutting down"
        try:
            while not stop.is_set():
                self._wait_for_command(self._idle_wait_s())
                self.run_once()
        except BaseException as e:
            why = f"fleet loop crashed: {type(e).__name__}: {e}"
            raise
        finally:
            self._drain()
            for fr in list(self.requests.values()):
                self._fail(fr, FailureKind.FLEET_STOPPED, why)
            self.replans.close(why)

    def run_once(self) -> None:
        """One iteration. Readers are woken once per group report and at the end of the iteration
        (``wakeups``), not once per event."""
        now = time.monotonic()
        with self.wakeups.deferred():
            self._drain()
            self._watch_groups(now)
            self._expire(now)
            self._dispatch_prefill()
            self._dispatch_handoffs()
            for member in self.members:
                member.client.flush()
        self.publish(now)

    def _idle_wait_s(self) -> float:
        """How long the loop may sleep: until the nearest deadline, at most half a second."""
        deadlines = [fr.deadline for fr in self.requests.values() if fr.deadline is not None]
        left = min(deadlines) - time.monotonic() if deadlines else 0.5
        return min(0.5, max(self.fleet_config.idle_poll_s, left))

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
        elif kind == "replan":
            self.replans.ask(arg, self.members)
        elif kind == "report":
            self._on_report(*arg)
        elif kind == "failed":
            client, generation, reason = arg
            client.group.fail(reason, generation)

    # ----- ending and moving requests -----

    def _detach(self, fr: FleetRequest) -> None:
        """Take ``fr`` out of wherever it is (freeing its pages there)."""
        member = fr.member
        if member is not None:
            member.assigned.pop(fr.engine_id, None)
            member.client.send(Abort(fr.engine_id))
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
            if self.replans:
                self.replans.left(member)
            self.router.forget_group(member.group_id)  # its KV cache, prefixes included, is gone
            # The KV of every request on this group's engine went with it (or with its old
            # generation): re-prefill them (oldest first) here once it is back, or elsewhere.
            moved = sorted(member.assigned.values(), key=lambda fr: fr.submitted)
            why = f"group {member.group_id} failed: {member.group.last_error}"
            for fr in reversed(moved):
                self._requeue(fr, why)
            if moved:
                log.warning("%d requests moved off %s (%s)", len(moved), member.group_id, why)
            if member.group.state is GroupState.READY:
                member.client.reset()
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
        until it chooses none; ``place`` sends each to its group's engine (or ends or requeues it)."""
        if not waiting:
            return
        members = {s.group_id: s for s in self.members if s.role in roles}
        loads = [s.load(self.max_model_len) for s in members.values()]
        while waiting:
            fr = waiting[0]
            load = pick(loads, fr)
            if load is None:
                return
            waiting.popleft()
            place(members[load.group_id], load, fr)

    def _place(self, member: FleetMember, fr: FleetRequest, command, load: GroupLoad, num_kv: int,
               tokens: int) -> None:
        """Send ``command`` (placing ``fr`` on ``member``'s engine) and count it against ``load``."""
        member.client.send(command, self.router.pages(num_kv), tokens, 1)
        member.assigned[command.engine_id] = fr
        fr.member, fr.engine_id = member, command.engine_id
        self.router.assign(load, fr, num_kv, tokens)

    def _prefill(self, member: FleetMember, load: GroupLoad, fr: FleetRequest) -> None:
        fr.attempts += 1
        engine_id = f"{fr.request_id}#{next(self._placements)}"
        cached, tokens = self.router.prefill_work(load, fr)
        command = Admit(engine_id, list(fr.prompt_ids), fr.params, fr.seed, list(fr.output_ids), list(fr.logprobs),
                        hand_off=member.role == "prefill", expected_cached_tokens=cached)
        if fr.holds_admission:
            fr.holds_admission = False
            self.router.gate.release()
        self._place(member, fr, command, load, fr.num_tokens, tokens)

    def _hand_off(self, member: FleetMember, load: GroupLoad, fr: FleetRequest) -> None:
        try:
            shards = self.transport.shards_for(fr.payload, member.group, self.cluster.handoff_timeout_s)
        except KVTransferFailed as e:
            self._requeue(fr, str(e))
            return
        fr.shards = shards
        command = Prefilled(f"{fr.request_id}#{next(self._placements)}", list(fr.prompt_ids), list(fr.output_ids),
                            fr.params, fr.seed, list(fr.logprobs), self.transport.name, shards,
                            self.cluster.handoff_timeout_s)
        self._place(member, fr, command, load, fr.num_tokens - 1, fr.remaining_output(self.max_model_len))

    # ----- reports -----

    def _on_report(self, client: GroupClient, generation: int, report: GroupReport) -> None:
        member = next(m for m in self.members if m.client is client)
        if generation != client.generation:
            return  # from a generation the loop has moved off (its requests were moved too)
        client.update(report)
        for done in report.replans:
            self.replans.answered(member.group_id, done)
        for ev in report.events:
            fr = member.assigned.get(ev.request_id)
            if fr is None:  # ended or moved since: the engine's late news of it is dropped
                continue
            if ev.finish_reason == "handoff":
                self._staged(member, fr, ev, report)
            elif ev.finished:
                del member.assigned[ev.request_id]
                fr.member = None
                failure = (ev.failure or FailureKind.GROUP_FAILED) if ev.finish_reason == "error" else None
                final = dataclasses.replace(ev, request_id=fr.request_id, failure=failure)
                self._end(fr, ev.finish_reason, ev.error, final, failure)
            else:
                fr.deliver(_progress(fr, ev))
        for engine_id in report.accepted:
            fr = member.assigned.get(engine_id)
            if fr is not None:
                fr.payload = fr.shards = None  # imported: the staged copies can go
        for refused in report.refused:
            fr = member.assigned.pop(refused.engine_id, None)
            if fr is None:
                continue
            fr.member = None
            if refused.kind == "no_room":  # the engine filled up since the router looked: wait again
                self.router.handoffs.appendleft(fr)
            elif refused.kind == "rejected":
                self._fail(fr, FailureKind.REJECTED, f"rejected by group {member.group_id}: {refused.message}")
            else:
                self.transport.transfer_failed(fr.payload, member.group, fr.shards)
                if refused.fail_group:
                    member.group.fail(refused.message, generation)
                self._requeue(fr, f"KV hand-off to {member.group_id} failed: {refused.message}")
        self.wakeups.flush()  # this group's tokens go out before the next report is read

    def _staged(self, member: FleetMember, fr: FleetRequest, ev: RequestEvent, report: GroupReport) -> None:
        """``fr`` sampled its first token on prefill group ``member``, which staged its KV: queue its hand-off."""
        del member.assigned[ev.request_id]
        fr.member = None
        fr.deliver(_progress(fr, ev))
        staged = report.staged.get(ev.request_id)
        if staged is None or staged.error is not None:
            why = staged.error if staged is not None else "nothing was staged"
            self._requeue(fr, f"KV export from {member.group_id} failed: {why}")
            return
        try:
            fr.payload = self.transport.payload(member.group, staged.transfer_id, staged.num_pages, staged.num_tokens)
        except KVTransferFailed as e:
            self._requeue(fr, str(e))
            return
        self.router.handoffs.append(fr)

    # ----- health -----

    def publish(self, now: float) -> None:
        """Rebuild the health snapshot (``health``, under ``health_lock``) as of ``now``."""
        groups = {}
        for s in self.members:
            g = s.group
            free, usable, _, outstanding = s.client.load()
            groups[s.group_id] = {
                "role": s.role, "state": s.health_state(now, self.cluster.lost_after_s), "phase": g.state.value,
                "tp_size": g.config.cluster.tp_size, "generation": g.generation, "restarts": g.restarts,
                "last_error": g.last_error, "num_pages": usable, "free_pages": free, "requests": len(s.assigned),
                "outstanding_tokens": outstanding,
                "waiting": g.waiting.health(now) if g.waiting is not None else None,
                "prefix_keys": self.router.affinity.size(s.group_id),
                "start_seconds": dict(g.start_seconds),
            }
        states = {v["state"] for v in groups.values()}
        roles_lost = any(self._role_lost(r, now) for r in {s.role for s in self.members})
        status = "dead" if roles_lost else "ready" if states == {"ready"} else \
            "starting" if states <= {"ready", "starting", "capturing"} else "degraded"
        snapshot = {"status": status, "mode": self.cluster.mode, "groups": groups,
                    "queued": len(self.router.queue), "handoffs": len(self.router.handoffs),
                    "in_flight": len(self.requests), "finished": self.finished, "failed": self.failed,
                    "routing": {"policy": self.router.policy, "prefix_routed": self.router.prefix_routed}}
        with self.health_lock:
            self.health = snapshot


def _progress(fr: FleetRequest, ev: RequestEvent) -> RequestEvent:
    """An engine's event of ``fr`` as its client sees it while it goes on: under its request id, not
    finished (a hand-off's first token too), everything else as the engine said."""
    return dataclasses.replace(ev, request_id=fr.request_id, finished=False, finish_reason=None)
