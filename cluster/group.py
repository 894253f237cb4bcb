"""A tensor-parallel worker group: ``tp_size`` rank actors in one placement group.

Rank 0 is the group's *leader*: it runs every step first-hand and hands each one to the other
ranks (its *followers*) over the generation's step channel (:mod:`cluster.step_channel`: a gloo
broadcast, no Ray call per rank per step), and every rank runs the same step (same predicate,
same graph replay or eager path, same seeded sampling); only the leader's tokens are read. A
fleet group runs its engine on the leader too (:mod:`cluster.engine_host`); a bare group is the
executor of an engine in the caller's process (one Ray call to the leader per step). Each
follower's loop, and a fleet leader's engine loop, is a Ray call that lasts as long as its
generation: the group watches them, so a rank's death is seen at once, not at the next step. A
rank that dies, or a step slower than ``cluster.step_timeout_s``, fails the whole generation: its
ranks are killed, its placement group removed, and a fresh generation starts in the background.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import ray
from ray.exceptions import GetTimeoutError, RayError

from cluster.config import GroupConfig
from cluster.generation import RankGeneration, failure_reason
from cluster.rank import GroupFailed, GroupState, GroupUnavailable, PlacementWait
from cluster.rank_actor import RankActor
from worker.step_message import StepMessage, StepResult

log = logging.getLogger(__name__)

#: First wait before a failed restart is tried again, and the longest (the wait doubles in between).
_RESTART_BACKOFF_S = 1.0
_RESTART_BACKOFF_MAX_S = 30.0


class WorkerGroup:
    """A self-healing tensor-parallel group of rank actors (the engine's executor)."""

    rank_actor_cls = RankActor  #: the actor class of each rank; subclasses add per-rank methods

    def __init__(self, config: GroupConfig, group_id: str = "g0", role: str = "colocated",
                 on_state: Callable[[str, GroupState, PlacementWait | None], None] | None = None,
                 cancel: threading.Event | None = None) -> None:
        """Start the group (blocks until it is ready or failed).

        ``on_state(group_id, state, waiting)`` is called on every lifecycle change, and about every
        second while the group's placement group waits for resources (``waiting``, else None), from
        the thread making it (e.g. to report start-up phases). Setting ``cancel`` ends a start (the
        first or a restart) at its next look: while it waits for resources, or between phases.
        """
        if not ray.is_initialized():
            raise RuntimeError("ray is not initialized: call ray.init(...) (tests: _node_ip_address='127.0.0.1')")
        self.config, self.group_id, self.role = config, group_id, role
        self._on_state = on_state
        self._cancel = cancel
        self._cond = threading.Condition()
        self._state = GroupState.STARTING
        self.waiting: PlacementWait | None = None  #: set while the current start waits for resources
        self._generation = 0
        self._current: RankGeneration | None = None
        self._closed = False
        self.restarts = 0
        self.last_error: str | None = None
        self.start_seconds: dict[str, float] = {}  #: the last ready generation's start, per phase
        self._start()
        if self._state is not GroupState.READY:
            raise GroupUnavailable(f"group {group_id} failed to start: {self.last_error}")

    # ----- lifecycle -----

    @property
    def state(self) -> GroupState:
        return self._state

    def health(self) -> dict:
        waiting = self.waiting
        return {"group": self.group_id, "role": self.role, "state": self._state.value,
                "generation": self._generation, "restarts": self.restarts, "last_error": self.last_error,
                "start_seconds": dict(self.start_seconds),
                "waiting": waiting.health(time.monotonic()) if waiting is not None else None}

    def _set_state(self, state: GroupState, waiting: PlacementWait | None = None) -> None:
        with self._cond:
            self._state = state
            self.waiting = waiting
            self._cond.notify_all()
        if self._on_state is not None:
            self._on_state(self.group_id, state, waiting)

    def _cancelled(self) -> bool:
        return self._closed or (self._cancel is not None and self._cancel.is_set())

    def _start(self) -> None:
        gen = RankGeneration(self.group_id, self._generation, self.config, self.role, self.rank_actor_cls)
        self._set_state(GroupState.STARTING)
        try:
            fixed = self.num_pages if self._generation > 0 else None
            self.arch, self.num_pages, self.max_len = gen.start(self._set_state, fixed, self._cancelled)
            self._prepare(gen)
        except (RayError, GroupUnavailable, RuntimeError) as e:
            self.last_error = f"start of generation {self._generation} failed: {e}"
            (log.info if self._cancelled() else log.error)("group %s: %s", self.group_id, self.last_error)
            gen.kill()
            self._set_state(GroupState.DEAD)
            return
        with self._cond:
            if self._closed:
                gen.kill()
                return
            self._current = gen
        self.start_seconds = dict(gen.start_seconds)
        self._set_state(GroupState.READY)
        phases = ", ".join(f"{name} {secs:.1f}s" for name, secs in gen.start_seconds.items())
        log.info("group %s generation %d ready in %.1fs (%s): %d ranks, %d KV pages", self.group_id,
                 self._generation, sum(gen.start_seconds.values()), phases, self.config.cluster.tp_size,
                 self.num_pages)

    def _prepare(self, gen: RankGeneration) -> None:
        """Subclasses' last step of a generation's start, before it is ready (nothing here)."""

    @property
    def generation(self) -> int:
        """The number of the current (or starting) generation, from 0."""
        return self._generation

    def current(self) -> RankGeneration | None:
        """The ready generation (None while none is)."""
        return self._current

    def fail(self, reason: str, generation: int | None = None) -> None:
        """Declare this generation dead (e.g. a KV import into it timed out and may still write);
        it is killed and, with ``cluster.restart``, replaced in the background. With ``generation``,
        only if that generation is still the current one (a late report of an old one is ignored)."""
        with self._cond:
            gen = self._current
            if gen is None or (generation is not None and gen.generation != generation):
                return
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        """Kill the current generation and (if configured) start a fresh one in the background."""
        self.last_error = reason
        log.error("group %s generation %d dead: %s", self.group_id, self._generation, reason)
        with self._cond:
            gen, self._current = self._current, None
        self._set_state(GroupState.DEAD)
        if gen is not None:
            gen.kill()
        if self.config.cluster.restart and not self._closed:
            threading.Thread(target=self._restart, name=f"restart-{self.group_id}", daemon=True).start()

    def _restart(self) -> None:
        """Start fresh generations until one is ready or the group is shut down.

        A start that fails (a rank killed while starting or capturing, a placement that cannot be
        met) is retried after a backoff that doubles from ``_RESTART_BACKOFF_S`` up to
        ``_RESTART_BACKOFF_MAX_S``; meanwhile the group is dead, and lost to its requests once
        ``cluster.lost_after_s`` has passed.
        """
        delay = _RESTART_BACKOFF_S
        while True:
            self._generation += 1
            self.restarts += 1
            self._start()
            with self._cond:
                if self._state is GroupState.READY or self._closed:
                    return
                log.warning("group %s: restart failed; next attempt in %.0fs", self.group_id, delay)
                self._cond.wait(delay)  # shutdown() wakes it
                if self._closed:
                    return
            delay = min(2 * delay, _RESTART_BACKOFF_MAX_S)

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the group is ready (True) or ``timeout_s`` passes / it stays dead (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._state is not GroupState.READY:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(min(left, 1.0))
                if self._state is GroupState.DEAD and not self.config.cluster.restart:
                    return False
            return True

    # ----- the executor interface -----

    def execute(self, msg: StepMessage) -> StepResult:
        """Run one step on every rank; raises GroupFailed (group now dead) or GroupUnavailable."""
        return self.submit(msg).result()

    def submit(self, msg: StepMessage) -> _GroupStep:
        """Send one step to every rank without waiting (steps run in submission order); its
        ``result()`` raises as :meth:`execute` does."""
        if not self.wait_ready(self.config.cluster.start_timeout_s):
            raise GroupUnavailable(f"group {self.group_id} is {self._state.value}: {self.last_error}")
        gen = self._current
        try:
            return _GroupStep(self, gen, gen.submit(msg))
        except RayError as e:
            self._step_failed(gen, e)

    def _collect(self, gen: RankGeneration, sent) -> StepResult:
        try:
            return gen.collect(sent, self.config.cluster.step_timeout_s)
        except RayError as e:
            self._step_failed(gen, e)

    def _step_failed(self, gen: RankGeneration, error: RayError) -> NoReturn:
        """Fail the generation a step failed on (a later step's failure of it is the same)."""
        if isinstance(error, GetTimeoutError):
            reason = f"step exceeded cluster.step_timeout_s={self.config.cluster.step_timeout_s}s"
        else:
            reason = failure_reason(gen, error)
        if gen is self._current:
            self._fail(reason)
        raise GroupFailed(f"group {self.group_id}: {reason}") from None

    def dead_ranks(self, timeout_s: float = 5.0) -> list[int]:
        """Ranks of the current generation that no longer answer a ping (none while none runs)."""
        gen = self._current
        return gen.dead_ranks(timeout_s) if gen is not None else []

    def rank_actors(self) -> list:
        """The live rank actors (for health probes and fault-injection tests)."""
        gen = self._current
        return list(gen.actors) if gen is not None else []

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            gen, self._current = self._current, None
            self._cond.notify_all()
        if gen is not None:
            gen.kill()
        self._set_state(GroupState.DEAD)


class _GroupStep:
    """A step sent to one generation of a group; :meth:`result` waits for rank 0's tokens."""

    def __init__(self, group: WorkerGroup, gen: RankGeneration, sent) -> None:
        self._group, self._gen, self._sent = group, gen, sent
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._group._collect(self._gen, self._sent)
        return self._result
