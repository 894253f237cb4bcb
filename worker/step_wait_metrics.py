"""How the thread that reads each step's tokens back waits: seconds waited and CPU burnt meanwhile.

On a group's leader rank that thread is the engine loop, so ``rate(graphfleet_step_wait_cpu_seconds_total)
/ rate(graphfleet_step_wait_seconds_total)`` is the share of a core the loop burns while it waits on
the device: near 0 when it sleeps, near 1 when it spins (:mod:`worker.readback` naps, then spins
briefly near the expected end).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class StepWaitMetrics:
    """``graphfleet_step_wait_seconds_total`` and ``graphfleet_step_wait_cpu_seconds_total`` in
    ``registry``, with constant ``labels`` (a fleet rank's group, rank, role)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str] | None = None) -> None:
        labels = dict(labels or {})
        names = list(labels)
        wait = Counter("graphfleet_step_wait_seconds", "Seconds the thread reading steps' tokens back waited "
                       "for the device", names, registry=registry)
        cpu = Counter("graphfleet_step_wait_cpu_seconds", "CPU seconds that thread spent while it waited "
                      "(sleeping costs none; spinning one per second)", names, registry=registry)
        self._wait = wait.labels(**labels) if labels else wait
        self._cpu = cpu.labels(**labels) if labels else cpu

    def record(self, wait_s: float, cpu_s: float) -> None:
        """One step's wait and the waiting thread's CPU during it."""
        self._wait.inc(max(0.0, wait_s))
        self._cpu.inc(max(0.0, cpu_s))
