"""A worker group whose ranks can hand KV pages over (the fleet's prefill and decode groups)."""

from __future__ import annotations

import ray

from cluster.fleet_rank import FleetRankActor
from cluster.group import WorkerGroup
from cluster.rank import GroupUnavailable


class FleetWorkerGroup(WorkerGroup):
    """A :class:`WorkerGroup` of :class:`FleetRankActor` ranks, tagged with its fleet role."""

    rank_actor_cls = FleetRankActor

    @property
    def tp_size(self) -> int:
        return self.config.cluster.tp_size

    def kv_layouts(self, timeout_s: float) -> list:
        """Every rank's :class:`worker.kv_pages.KVLayout`, in rank order."""
        actors = self.rank_actors()
        if not actors:
            raise GroupUnavailable(f"group {self.group_id} is {self.state.value}: {self.last_error}")
        return ray.get([a.kv_layout.remote() for a in actors], timeout=timeout_s)
