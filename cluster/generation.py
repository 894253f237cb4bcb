"""One generation of a worker group: its rank actors, their placement group, and the Ray calls
that last its life (see :mod:`cluster.group`, which starts a new generation after each failure)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import GroupConfig
from cluster.rank import GroupState, GroupUnavailable, PlacementWait, RankInfo
from cluster.rank_actor import RankActor
from worker.step_message import StepMessage, StepResult

log = logging.getLogger(__name__)

#: Seconds between looks at a pending placement group (and refreshes of what the cluster has free).
_WAIT_REFRESH_S = 1.0


class RankGeneration:
    """One generation of a group: its started rank actors, their placement group, and the Ray calls
    that last its whole life (``loops``: each follower's :meth:`RankActor.follow`, and a fleet leader's
    engine loop), which end with an error when their rank dies."""

    def __init__(self, group_id: str, generation: int, config: GroupConfig, role: str, actor_cls=RankActor) -> None:
        self.group_id, self.generation, self.config, self.role = group_id, generation, config, role
        self.actor_cls = actor_cls
        self.actors: list = []
        self.pg = None
        self.loops: list = []
        self.engine_loop = None  #: a fleet leader's engine loop (one of ``loops``), once started
        self.report_address = None  #: where a fleet leader's reports are read (:mod:`cluster.report_link`)
        #: Seconds each phase of :meth:`start` took, in order: placement (waiting for resources),
        #: rendezvous (actors up, process groups joined), load (weights), allocate (KV cache), capture
        #: (CUDA graphs, with the kernels compiled on their first use).
        self.start_seconds: dict[str, float] = {}

    def start(self, on_state, fixed_pages: int | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> tuple[object, int, int]:
        """Place, start, rendezvous, load, allocate and capture; returns (arch, pages, max_model_len).

        ``on_state(state, waiting)`` hears each phase, and about every second a refreshed
        :class:`PlacementWait` while the placement group waits for resources. ``cancelled()`` is
        polled while it waits and between phases: True ends the start with ``GroupUnavailable``.
        """
        c = self.config.cluster
        tp, deadline = c.tp_size, time.monotonic() + c.start_timeout_s
        gpus = c.gpus_per_rank if _use_gpus(self.config) else 0
        # A GPU rank reserves only its GPU share (a CPU slot per rank kept small hosts from placing
        # every group); a bundle may not be empty, hence the CPU share of a CPU rank.
        bundle = {"GPU": gpus} if gpus else {"CPU": c.cpus_per_rank}
        self.pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK",
                                  name=f"graphfleet-{self.group_id}-{self.generation}")
        clock = _PhaseClock(self.start_seconds)
        self._wait_placed(bundle, deadline, on_state, cancelled)
        clock.lap("placement")
        groups = getattr(self.actor_cls, "concurrency_groups", None)
        actor_cls = ray.remote(concurrency_groups=groups)(self.actor_cls) if groups else ray.remote(self.actor_cls)
        config_dict = GroupConfig.of(self.config).to_dict()
        for rank in range(tp):
            info = RankInfo(self.group_id, self.generation, rank, tp, self.role)
            self.actors.append(actor_cls.options(
                num_cpus=0 if gpus else c.cpus_per_rank, num_gpus=gpus, max_restarts=0, max_task_retries=0,
                name=f"graphfleet-{info.group_id}-{info.generation}-rank{rank}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank,
                    placement_group_capture_child_tasks=True),
            ).remote(info, config_dict))
        init = ray.get(self.actors[0].rendezvous_address.remote(), timeout=_left(deadline))
        backend = "nccl" if gpus else "gloo"
        # Every rank joins at once: a sequential join would deadlock inside init_process_group.
        self._all("init_distributed", deadline, init, backend, c.step_timeout_s)
        clock.lap("rendezvous")
        _check_cancelled(cancelled)
        pages = min(self._all("load", deadline))
        clock.lap("load")
        if fixed_pages is not None:  # a restart must hold exactly the pages the engine books against
            if pages < fixed_pages:
                raise GroupUnavailable(f"restarted ranks hold {pages} KV pages, the engine needs {fixed_pages}")
            pages = fixed_pages
        max_len = min(self._all("max_model_len", deadline, pages))
        self._all("allocate", deadline, pages, max_len)
        clock.lap("allocate")
        _check_cancelled(cancelled)
        on_state(GroupState.CAPTURING, None)
        self._all("capture", deadline)
        clock.lap("capture")
        arch = ray.get(self.actors[0].arch.remote(), timeout=_left(deadline))
        self.loops = [a.follow.remote() for a in self.actors[1:]]
        return arch, pages, max_len

    def _wait_placed(self, bundle: dict, deadline: float, on_state, cancelled: Callable[[], bool]) -> None:
        """Wait for the placement group, bounded by ``deadline``; report and log a wait past the first second."""
        ready, tp, asked = self.pg.ready(), self.config.cluster.tp_size, time.monotonic()
        waiting: PlacementWait | None = None
        while True:
            done, _ = ray.wait([ready], timeout=min(_WAIT_REFRESH_S, _left(deadline)))
            if done:
                ray.get(ready)
                if waiting is not None:
                    log.info("group %s: placed after waiting %.1fs for resources", self.group_id,
                             time.monotonic() - waiting.since)
                    on_state(GroupState.STARTING, None)
                return
            free = _free(bundle)
            if cancelled():
                raise GroupUnavailable(f"start cancelled while waiting for resources ({tp} x {bundle} asked, "
                                       f"{free} free)")
            if time.monotonic() >= deadline:
                raise GroupUnavailable(f"placement group for {tp} ranks x {bundle} not ready after "
                                       f"{self.config.cluster.start_timeout_s:.0f}s: the cluster lacks those "
                                       f"resources ({free} free)")
            if waiting is None:
                waiting = PlacementWait(dict(bundle), tp, free, asked)
                log.warning("group %s: waiting for resources: its placement group asks %d x %s, the cluster has "
                            "%s free (bounded by cluster.start_timeout_s=%gs)", self.group_id, tp, bundle, free,
                            self.config.cluster.start_timeout_s)
            else:
                waiting = dataclasses.replace(waiting, available=free)
            on_state(GroupState.STARTING, waiting)

    @property
    def leader(self):
        return self.actors[0]

    def _all(self, method: str, deadline: float, *args):
        return ray.get([getattr(a, method).remote(*args) for a in self.actors], timeout=_left(deadline))

    def submit(self, msg: StepMessage):
        """Send a step to the leader (which hands it to the followers); what :meth:`collect` waits on."""
        return self.leader.execute.remote(msg)

    def collect(self, sent, timeout_s: float) -> StepResult:
        """The step's result (see :meth:`result_beside_loops`)."""
        return self.result_beside_loops(sent, timeout_s)

    def result_beside_loops(self, ref, timeout_s: float):
        """``ray.get(ref)``, watching the generation's ``loops`` meanwhile: raises ``GetTimeoutError``
        after ``timeout_s``, and the error a rank's loop ended with as soon as one ends (``RayActorError``
        when its rank died)."""
        ready, _ = ray.wait([ref, *self.loops], num_returns=1, timeout=timeout_s)
        if not ready:
            raise GetTimeoutError(f"not done after {timeout_s:g}s")
        if ready[0] is not ref:
            self._raise_ended(ready[0])
        return ray.get(ref)

    def watch_loops(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for one of ``loops`` to end: raises the error it ended with (or
        ``RayActorError`` if it returned) when one does, ``GetTimeoutError`` when none did."""
        if not self.loops:
            time.sleep(timeout_s)
            raise GetTimeoutError(f"no rank call to watch after {timeout_s:g}s")
        ready, _ = ray.wait(list(self.loops), num_returns=1, timeout=timeout_s)
        if not ready:
            raise GetTimeoutError(f"no rank call ended within {timeout_s:g}s")
        self._raise_ended(ready[0])

    def _raise_ended(self, loop) -> None:
        ray.get(loop)
        rank = 0 if loop is self.engine_loop else self.loops.index(loop) + 1
        raise RayActorError(f"rank {rank}'s loop ended while its generation was live")

    def dead_ranks(self, timeout_s: float = 5.0) -> list[int]:
        """Ranks that no longer answer a ping within ``timeout_s``."""
        dead = []
        for rank, a in enumerate(self.actors):
            try:
                ray.get(a.ping.remote(), timeout=timeout_s)
            except RayError:
                dead.append(rank)
        return dead

    def kill(self, graceful_s: float = 5.0) -> None:
        """Release graphs and the process group where the ranks still answer, then kill them.

        The leader goes first (it stops its engine loop and tells the followers to stop), then the
        followers; each wait is bounded, so a stuck or dead rank holds nothing up.
        """
        if self.actors:
            ray.wait([self.leader.shutdown.remote()], timeout=graceful_s)
            refs = [a.shutdown.remote() for a in self.actors[1:]]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=graceful_s)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        self.loops = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def failure_reason(gen: RankGeneration, error: BaseException) -> str:
    """Why ``gen`` failed with ``error``: "a rank died: rank N (...)" when ranks no longer answer
    (a follower's death also breaks the leader's step), else "a rank failed the step: ..."."""
    first_line = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    dead = gen.dead_ranks(timeout_s=2.0)
    if dead:
        return f"a rank died: rank {', '.join(map(str, dead))} ({first_line})"
    if isinstance(error, RayActorError):
        return f"a rank died: {first_line}"
    return f"a rank failed the step: {first_line}"


class _PhaseClock:
    """Writes the seconds since the previous lap into ``into[name]`` at each :meth:`lap`."""

    def __init__(self, into: dict[str, float]) -> None:
        self._into, self._last = into, time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self._into[name] = round(now - self._last, 3)
        self._last = now


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _free(bundle: dict) -> dict[str, float]:
    """What the cluster has free of each resource ``bundle`` names."""
    available = ray.available_resources()
    return {k: round(available.get(k, 0.0), 4) for k in bundle}


def _check_cancelled(cancelled: Callable[[], bool]) -> None:
    if cancelled():
        raise GroupUnavailable("start cancelled")


def _use_gpus(config: GroupConfig) -> bool:
    if config.model.device == "cpu":
        return False
    has = ray.cluster_resources().get("GPU", 0) >= config.cluster.tp_size * config.cluster.gpus_per_rank
    if config.model.device == "cuda" and not has:
        raise GroupUnavailable(f"model.device=cuda but the Ray cluster has "
                               f"{ray.cluster_resources().get('GPU', 0)} GPUs for tp_size={config.cluster.tp_size}")
    return has
