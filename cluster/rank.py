"""Identity of one rank in one worker group, the group's lifecycle states, and its wait for resources."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from worker.executor import ExecutorFailed, ExecutorUnavailable


class GroupState(str, enum.Enum):
    """Lifecycle of a worker group, as health checks report it."""

    STARTING = "starting"
    CAPTURING = "capturing"
    READY = "ready"
    DEAD = "dead"


#: What health reports for a group in :class:`PlacementWait` (a sub-state of ``starting``).
WAITING_FOR_RESOURCES = "waiting for resources"


@dataclass(frozen=True)
class PlacementWait:
    """A starting group whose placement group the cluster cannot place yet (state ``starting``).

    bundle: what each rank asks for (e.g. ``{"CPU": 0.25}`` or ``{"GPU": 1.0}``); count: bundles
    (ranks); available: what the cluster has free of those resources (``ray.available_resources()``,
    refreshed about every second while the group waits); since: ``time.monotonic()`` when the wait began.
    """

    bundle: dict[str, float]
    count: int
    available: dict[str, float] = field(default_factory=dict)
    since: float = 0.0

    def health(self, now: float) -> dict:
        """The wait as health reports it: state, what was asked (bundle x count), what is free, for how long."""
        return {"state": WAITING_FOR_RESOURCES, "asked": {"bundle": dict(self.bundle), "count": self.count},
                "available": dict(self.available), "waiting_s": round(max(0.0, now - self.since), 1)}

    def describe(self) -> str:
        return f"{self.count} x {self.bundle} asked, {self.available} free"


@dataclass(frozen=True)
class RankInfo:
    """Rank ``rank`` of ``world_size`` in group ``group_id`` (generation ``generation``)."""

    group_id: str
    generation: int
    rank: int
    world_size: int
    role: str = "colocated"

    @property
    def name(self) -> str:
        return f"{self.group_id}.{self.generation}/rank{self.rank}"


class GroupFailed(ExecutorFailed):
    """A group's step could not complete (a rank died or the step timed out); the group is dead."""


class GroupUnavailable(ExecutorUnavailable):
    """No live group can run steps (it is restarting past the wait, or gave up restarting)."""
