"""Identity of one rank in one worker group, and the group's lifecycle states."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from worker.executor import ExecutorFailed, ExecutorUnavailable


class GroupState(str, enum.Enum):
    """Lifecycle of a worker group, as health checks report it."""

    STARTING = "starting"
    CAPTURING = "capturing"
    READY = "ready"
    DEAD = "dead"


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
