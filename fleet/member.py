"""One group of a fleet as the fleet's loop sees it: its worker group, its engine's client, its requests."""

from __future__ import annotations

from cluster.rank import GroupState
from fleet.group_client import GroupClient
from fleet.request import FleetRequest
from fleet.router import GroupLoad


class FleetMember:
    """One group of the fleet: its worker group, the client of its engine, and the requests placed on it."""

    def __init__(self, group_id: str, role: str, group) -> None:
        self.group_id, self.role, self.group = group_id, role, group
        self.client: GroupClient | None = None  # set by the loop that owns it
        self.assigned: dict[str, FleetRequest] = {}  # engine id -> request placed on the engine
        self.dead_since: float | None = None

    @property
    def ready(self) -> bool:
        """Ready, and the loop has taken its current generation on."""
        return self.group.state is GroupState.READY and self.client.generation == self.group.generation

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

    def load(self, max_model_len: int) -> GroupLoad:
        free, usable, requests, tokens = self.client.load()
        return GroupLoad(self.group_id, self.role, self.ready, free, requests,
                         self.group.config.scheduler.max_running_requests, tokens, max_model_len, usable)
