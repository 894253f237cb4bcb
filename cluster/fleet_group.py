"""A worker group whose leader hosts the group's engine and whose ranks hand KV pages over (a fleet's group)."""

from __future__ import annotations

import ray

from cluster.fleet_rank import FleetRankActor
from cluster.generation import RankGeneration
from cluster.group import WorkerGroup
from cluster.rank import GroupUnavailable


class FleetWorkerGroup(WorkerGroup):
    """A :class:`WorkerGroup` of :class:`FleetRankActor` ranks, tagged with its fleet role.

    Once :meth:`host_engine` has been called, every generation of the group (the current one, and
    each restart before it is ready) runs its engine on its leader (:mod:`cluster.engine_host`).
    """

    rank_actor_cls = FleetRankActor
    _engine_max_len: int | None = None

    @property
    def tp_size(self) -> int:
        return self.config.cluster.tp_size

    def host_engine(self, max_model_len: int) -> None:
        """Run the group's engine on its leader, stopping sequences at ``max_model_len`` (the fleet's
        shortest), now and on every later generation."""
        self._engine_max_len = max_model_len
        gen = self.current()
        if gen is None:
            raise GroupUnavailable(f"group {self.group_id} is {self.state.value}: {self.last_error}")
        self._start_engine(gen)

    def _prepare(self, gen: RankGeneration) -> None:
        if self._engine_max_len is not None:
            self._start_engine(gen)

    def _start_engine(self, gen: RankGeneration) -> None:
        gen.report_address = ray.get(gen.leader.start_engine.remote(self._engine_max_len),
                                     timeout=self.config.cluster.start_timeout_s)
        gen.engine_loop = gen.leader.serve_engine.remote()
        gen.loops.append(gen.engine_loop)

    def kv_layouts(self, timeout_s: float) -> list:
        """Every rank's :class:`worker.kv_pages.KVLayout`, in rank order."""
        actors = self.rank_actors()
        if not actors:
            raise GroupUnavailable(f"group {self.group_id} is {self.state.value}: {self.last_error}")
        return ray.get([a.kv_layout.remote() for a in actors], timeout=timeout_s)
