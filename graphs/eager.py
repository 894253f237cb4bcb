"""The eager runner: a phase that has no graphs.

When a phase captures nothing (graphs off by config, ``graphs.<phase>.backend=eager``, no CUDA
device for the configured backend) it still has a runner, so the model runner has one path per
phase: :meth:`EagerRunner.run` runs the eager forward and counts the pass as eager with the one
reason the phase has no graphs (``disabled``, ``no_cuda``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from graphs.buckets import BucketChoice
from graphs.metrics import GraphMetrics

Output = TypeVar("Output")


class EagerRunner:
    """Runs every pass of ``phase`` eagerly, counted in the metrics with ``reason``."""

    resident_bytes = 0  # no graph memory

    def __init__(self, phase: str, reason: str, metrics: GraphMetrics | None = None) -> None:
        self.phase = phase
        self.reason = reason
        self.metrics = metrics

    def decide(self, batch: object) -> BucketChoice:
        """Always eager, with this runner's reason."""
        return BucketChoice(None, self.reason)

    def run(self, batch: object, eager: Callable[[], Output], label: str | None = None) -> Output:
        """``eager()``, the pass counted as eager with this runner's reason, under the phase label
        ``label`` (default: this runner's phase)."""
        if self.metrics is not None:
            self.metrics.record_pass(label or self.phase, None, self.reason)
        return eager()

    def record_eager(self, reason: str, label: str | None = None) -> None:
        """Count one eager pass of this phase (or under ``label``) with ``reason`` (a pass run
        outside :meth:`run`)."""
        if self.metrics is not None:
            self.metrics.record_pass(label or self.phase, None, reason)

    def release(self) -> None:
        """Nothing to release (no graphs)."""
