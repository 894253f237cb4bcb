"""The fault soak's faults: a schedule of SIGKILLs and SIGSTOPs on a disaggregated fleet's ranks, and
the cluster seen from outside (rank actors and their processes, the Serve replica).

Used by :mod:`bench.soak` (the module docstring there says what the soak checks).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from bench.soak_load import get_health, group_phase

#: The fleet's name in the soak app: its groups are ``soak-p0`` (prefill) and ``soak-d0`` (decode).
FLEET = "soak"
GROUPS = {"prefill": f"{FLEET}-p0", "decode": f"{FLEET}-d0"}


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``kind`` on a rank of the ``role`` group, ``at_s`` after the load starts.

    kill: SIGKILL rank 0 of the current generation. stop: SIGSTOP it for ``stop_s`` (longer than
    the step timeout), then SIGCONT. kill_starting / kill_capturing: SIGKILL rank 0, then SIGKILL
    rank 0 of the restarting group's next generation as soon as it exists (starting) or once the
    group reports the capturing phase.
    """

    at_s: float
    kind: str
    role: str


def default_faults(duration_s: float) -> list[Fault]:
    """Every fault kind once, spread over the first 85% of ``duration_s``."""
    kinds = [("kill", "decode"), ("kill", "prefill"), ("stop", "decode"), ("kill_starting", "prefill"),
             ("kill_capturing", "prefill")]
    step = duration_s * 0.85 / (len(kinds) + 1)
    return [Fault(round(step * (i + 1), 1), kind, role) for i, (kind, role) in enumerate(kinds)]


@dataclass
class FaultRecord:
    """What one fault did: when it hit, which phase the group was in, and when the group was ready again."""

    kind: str
    role: str
    at: float
    hits: list[dict] = field(default_factory=list)  # {"t", "actor", "phase", "signal"}
    ready_again: float | None = None
    error: str | None = None


# ----- the cluster seen from outside: rank actors, their processes, the replica -----

def alive_actors() -> dict[str, int]:
    """Name -> process id of every named actor alive now.

    Read from the GCS actor table (``ray._private.state``): the public state API needs the
    dashboard, and asking an actor for its pid waits behind whatever it is running (a capture).
    """
    from ray._private.state import actors

    return {a["Name"]: a["Pid"] for a in actors().values() if a.get("Name") and a.get("State") == "ALIVE"}


def rank_actors(group_id: str) -> dict[int, tuple[str, int]]:
    """generation -> (name, pid) of rank 0 of each generation of ``group_id`` alive now."""
    prefix = f"graphfleet-{group_id}-"
    found = {}
    for name, pid in alive_actors().items():
        if name.startswith(prefix) and name.endswith("-rank0"):
            found[int(name[len(prefix):].split("-")[0])] = (name, pid)
    return found


def replica_pid(app: str = "graphfleet") -> int:
    """The process of the app's Serve replica (its one ``OpenAIIngress`` replica)."""
    pids = [pid for name, pid in alive_actors().items() if name.startswith(f"SERVE_REPLICA::{app}#OpenAIIngress#")]
    if len(pids) != 1:
        raise RuntimeError(f"expected one replica of app {app!r}, found pids {pids}")
    return pids[0]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ----- the faults -----

class FaultInjector(threading.Thread):
    """Runs the fault schedule against the fleet behind ``base`` (a thread beside the load)."""

    def __init__(self, base: str, faults: list[Fault], t0: float, stop_s: float, wait_s: float = 120.0) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.base, self.faults, self.t0, self.stop_s, self.wait_s = base, faults, t0, stop_s, wait_s
        self.records: list[FaultRecord] = []

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for fault in self.faults:
                await asyncio.sleep(max(0.0, self.t0 + fault.at_s - time.monotonic()))
                record = FaultRecord(fault.kind, fault.role, time.monotonic())
                self.records.append(record)
                try:
                    await self._inject(session, fault, record)
                    record.ready_again = await self._until_ready(session, GROUPS[fault.role])
                except Exception as e:  # noqa: BLE001 - recorded; the checks fail on it
                    record.error = f"{type(e).__name__}: {e}"

    async def _phase_now(self, session, group_id: str) -> str | None:
        return group_phase(await get_health(session, self.base), group_id)

    async def _hit(self, session, record: FaultRecord, group_id: str) -> int:
        """SIGKILL rank 0 of the newest generation of ``group_id``; that generation."""
        actors = rank_actors(group_id)
        if not actors:
            raise RuntimeError(f"{group_id} has no live rank 0 to hit")
        gen = max(actors)
        name, pid = actors[gen]
        _signal(record, name, pid, await self._phase_now(session, group_id), signal.SIGKILL)
        return gen

    async def _hit_next(self, session, record: FaultRecord, group_id: str, after: int, phase: str | None) -> None:
        """SIGKILL rank 0 of the first generation after ``after`` of ``group_id`` as soon as it exists (and the
        group reports ``phase``): the kill follows the sighting with nothing between them, since a capture
        on the GPU lasts seconds."""
        end = time.monotonic() + self.wait_s
        while time.monotonic() < end:
            actors = rank_actors(group_id)
            newer = [g for g in actors if g > after]
            if newer:
                seen = await self._phase_now(session, group_id)
                if phase is None or seen == phase:
                    name, pid = actors[max(newer)]
                    _signal(record, name, pid, seen, signal.SIGKILL)
                    return
            await asyncio.sleep(0.01)
        raise TimeoutError(f"{group_id}: no generation after {after} in phase {phase} within {self.wait_s}s")

    async def _inject(self, session, fault: Fault, record: FaultRecord) -> None:
        group_id = GROUPS[fault.role]
        if fault.kind == "kill":
            await self._hit(session, record, group_id)
        elif fault.kind == "stop":
            actors = rank_actors(group_id)
            if not actors:
                raise RuntimeError(f"{group_id} has no live rank 0 to stop")
            name, pid = actors[max(actors)]
            phase = await self._phase_now(session, group_id)
            os.kill(pid, signal.SIGSTOP)
            record.hits.append({"t": time.monotonic(), "actor": name, "phase": phase, "signal": "SIGSTOP"})
            await asyncio.sleep(self.stop_s)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # the group killed it on the step timeout, as it should
        elif fault.kind in ("kill_starting", "kill_capturing"):
            gen = await self._hit(session, record, group_id)
            phase = "capturing" if fault.kind == "kill_capturing" else None
            await self._hit_next(session, record, group_id, gen, phase)
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")

    async def _until_ready(self, session, group_id: str) -> float:
        end = time.monotonic() + self.wait_s
        await asyncio.sleep(0.5)  # let the fleet notice the fault first
        while time.monotonic() < end:
            health = await get_health(session, self.base)
            if (health.get("groups") or {}).get(group_id) == "ready":
                return time.monotonic()
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{group_id} not ready again within {self.wait_s}s")


def _signal(record: FaultRecord, actor: str, pid: int, phase: str | None, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise RuntimeError(f"{actor} (pid {pid}) was gone before {signal.Signals(sig).name}") from None
    record.hits.append({"t": time.monotonic(), "actor": actor, "phase": phase, "signal": signal.Signals(sig).name})
