"""Live graph re-plans the fleet has asked of its groups (:meth:`fleet.fleet.Fleet.replan`).

Owned by the loop thread (:mod:`fleet.loop`): it asks every ready group with a ``Replan`` command,
records the groups that are not ready as such, and resolves each re-plan's future once every group
asked has answered (a ``Replanned`` in its report) or left (failed, restarted, the loop stopped).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from cluster.group_messages import Replan, Replanned
from fleet.member import FleetMember


@dataclass
class PendingReplan:
    """One re-plan: ``future`` gets ``{group id: result}`` (a summary dict or ``{"error": why}``)."""

    replan_id: str
    future: Future = field(default_factory=Future)
    waiting: set[str] = field(default_factory=set)  # groups asked that have not answered
    results: dict[str, dict] = field(default_factory=dict)


class Replans:
    """The re-plans in progress."""

    def __init__(self) -> None:
        self._pending: dict[str, PendingReplan] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def ask(self, pending: PendingReplan, members: list[FleetMember]) -> None:
        """Send ``pending`` to every ready member (in its next command batch); the others are answered now."""
        for member in members:
            if member.ready:
                pending.waiting.add(member.group_id)
                member.client.send(Replan(pending.replan_id))
            else:
                pending.results[member.group_id] = {"error": f"group {member.group_id} is not ready "
                                                             f"({member.group.state.value}): not re-planned"}
        self._pending[pending.replan_id] = pending
        self._resolve_if_done(pending)

    def answered(self, group_id: str, done: Replanned) -> None:
        """``group_id`` reported ``done`` (of its current generation)."""
        pending = self._pending.get(done.replan_id)
        if pending is not None and group_id in pending.waiting:
            self._settle(pending, group_id, done.summary if done.error is None else {"error": done.error})

    def left(self, member: FleetMember) -> None:
        """``member`` is not ready (failed, or on a new generation): a re-plan asked of it gets no answer."""
        for pending in list(self._pending.values()):
            if member.group_id in pending.waiting:
                self._settle(pending, member.group_id, {"error": f"group {member.group_id} failed before it "
                                                                 f"re-planned: {member.group.last_error}"})

    def close(self, why: str) -> None:
        """The loop stops: every group still waited for answers ``why``."""
        for pending in list(self._pending.values()):
            for group_id in list(pending.waiting):
                self._settle(pending, group_id, {"error": why})

    def _settle(self, pending: PendingReplan, group_id: str, result: dict) -> None:
        pending.waiting.discard(group_id)
        pending.results[group_id] = result
        self._resolve_if_done(pending)

    def _resolve_if_done(self, pending: PendingReplan) -> None:
        if not pending.waiting:
            del self._pending[pending.replan_id]
            pending.future.set_result(dict(sorted(pending.results.items())))
