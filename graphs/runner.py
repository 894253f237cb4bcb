"""The runner base class: shapes, the replay-or-eager predicate, the capture loop, execution.

A runner owns everything about *which* shape a live batch replays and *how* it is loaded into
the static buffers; the backend (:mod:`graphs.backends`) owns how a shape is captured.
:class:`PhaseRunner` is what a model runner calls for one phase: a :class:`GraphRunner`, or the
:class:`graphs.eager.EagerRunner` of a phase without graphs.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from graphs.backends import CapturedShape, CaptureError, GraphBackend
from graphs.buckets import BucketChoice, choose_bucket, validate_ladder
from graphs.metrics import GraphMetrics
from graphs.process import release_warm_up_memory

log = logging.getLogger(__name__)

Batch = TypeVar("Batch")
Output = TypeVar("Output")


class PhaseRunner(Protocol[Batch, Output]):
    """One phase's passes: replayed when its predicate says so, else eager; counted either way."""

    phase: str

    @property
    def resident_bytes(self) -> int:
        """Graph memory this runner's captured shapes hold."""

    def decide(self, batch: Batch) -> BucketChoice:
        """The captured shape ``batch`` replays at, or the reason it runs eagerly (pure)."""

    def run(self, batch: Batch, eager: Callable[[], Output], label: str | None = None) -> Output:
        """Replay ``batch`` when :meth:`decide` says so, else return ``eager()``; records the pass
        under the phase label ``label`` (default: the runner's phase)."""

    def record_eager(self, reason: str, label: str | None = None) -> None:
        """Count one eager pass of this phase (or under ``label``) with ``reason`` (a pass run
        outside :meth:`run`)."""

    def release(self) -> None:
        """Release every captured graph (before what they point at)."""


@dataclass(frozen=True)
class CaptureSummary:
    phase: str
    backend: str
    shapes: int
    failed: int
    seconds: float
    resident_bytes: int

    def line(self) -> str:
        return (f"captured {self.shapes} {self.phase} shapes with the {self.backend} backend in "
                f"{self.seconds:.1f}s, {self.resident_bytes / 2**20:.1f} MiB graph memory"
                + (f", {self.failed} failed (running eagerly)" if self.failed else ""))


class GraphRunner(ABC, Generic[Batch, Output]):
    """Base of the decode and prefill runners.

    Subclasses provide the batch size of a live batch, the capture callable of a shape, and
    loading/slicing; the base decides, captures and executes. ``decide`` is pure: the same
    inputs give the same answer on every rank, which keeps tensor-parallel ranks in lockstep.
    """

    phase: str = "abstract"

    def __init__(self, backend: GraphBackend, ladder: list[int], padding: bool,
                 metrics: GraphMetrics | None = None) -> None:
        self.backend = backend
        self.ladder = validate_ladder(ladder, f"{self.phase} ladder")
        self.padding = padding
        self.metrics = metrics
        self.failed: dict[int, str] = {}

    # ----- the predicate -----

    def decide(self, batch: Batch) -> BucketChoice:
        """The captured shape ``batch`` replays at, or the reason it runs eagerly."""
        choice = self._choose(batch)
        if not choice.replays:
            return choice
        if choice.size in self.failed:
            return BucketChoice(None, "capture_failed")
        if not self.backend.has(choice.size):
            return BucketChoice(None, "not_captured")
        return choice

    def _choose(self, batch: Batch) -> BucketChoice:
        return choose_bucket(self.batch_size(batch), self.ladder, self.padding)

    # ----- capture -----

    def capture_all(self, progress: bool = True, timeout_s: float | None = None) -> CaptureSummary:
        """Capture every ladder shape, largest first; failures are recorded, not raised."""
        start = time.perf_counter()
        shapes = sorted(self.ladder, reverse=True)
        bar = _progress(len(shapes), f"capture {self.phase} ({self.backend.name})", progress)
        for size in shapes:
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"{self.phase} graph capture exceeded {timeout_s:.0f}s "
                                   f"(graphs.capture_timeout_s) at shape {size}")
            self.capture_one(size)
            bar(size)
        release_warm_up_memory(self.backend.device)
        summary = CaptureSummary(self.phase, self.backend.name, len(self.backend.shapes), len(self.failed),
                                 time.perf_counter() - start, self.backend.resident_bytes)
        if self.metrics is not None:
            self.metrics.record_capture(self.phase, summary.shapes, summary.seconds, summary.resident_bytes)
        log.info(summary.line())
        return summary

    def capture_one(self, size: int) -> CapturedShape | None:
        try:
            fn = self.capture_callable(size)
            return self.backend.capture(size, fn, phase=self.phase)
        except CaptureError as e:
            self.failed[size] = str(e)
            log.error("%s graph capture failed; that shape will run eagerly: %s", self.phase, e)
            return None

    @property
    def resident_bytes(self) -> int:
        """Graph memory of the captured shapes (measured by the backend)."""
        return self.backend.resident_bytes

    # ----- execution -----

    def run(self, batch: Batch, eager: Callable[[], Output], label: str | None = None) -> Output:
        """Replay ``batch`` when the predicate says so, else count the eager pass and return ``eager()``.

        ``label``: the phase label the pass is counted under (default :attr:`phase`; the prefill
        runner also runs ``mixed`` passes). A replayed result is a view of the static outputs:
        consume it before the next step.
        """
        choice = self.decide(batch)
        if choice.replays:
            return self.execute(batch, choice, label)
        self.record_eager(choice.reason, label)
        return eager()

    def execute(self, batch: Batch, choice: BucketChoice, label: str | None = None) -> Output:
        """Load ``batch`` into the static buffers of ``choice.size``, replay, slice the outputs
        (the pass counted under ``label``, default :attr:`phase`)."""
        if not choice.replays:
            raise ValueError(f"execute needs a shape to replay; decide() said eager ({choice.reason})")
        self.load(batch, choice.size)
        self.backend.replay(choice.size)
        if self.metrics is not None:
            phase = label or self.phase
            self.metrics.record_padding(phase, choice.size, self.batch_size(batch))
            self.metrics.record_pass(phase, self.backend.name if self.backend.is_graph else None,
                                     None if self.backend.is_graph else self.backend.name)
        return self.outputs(batch)

    def record_eager(self, reason: str, label: str | None = None) -> None:
        """Count one eager pass of this phase (or under ``label``) with ``reason``."""
        if self.metrics is not None:
            self.metrics.record_pass(label or self.phase, None, reason)

    def release(self) -> None:
        self.backend.release()

    # ----- subclass hooks -----

    @abstractmethod
    def batch_size(self, batch: Batch) -> int: ...

    @abstractmethod
    def capture_callable(self, size: int) -> Callable[[], None]:
        """Fill the static buffers with a dummy batch of ``size`` and return the callable to capture."""

    @abstractmethod
    def load(self, batch: Batch, size: int) -> None:
        """Copy ``batch`` into the static buffers, reset padding, plan metadata (host side)."""

    @abstractmethod
    def outputs(self, batch: Batch) -> Output:
        """The live rows of the static outputs."""


def _progress(total: int, desc: str, enabled: bool) -> Callable[[int], None]:
    if not enabled:
        return lambda _size: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="shape", leave=False)

    def step(size: int) -> None:
        bar.set_postfix(size=size)
        bar.update()
        if bar.n == total:
            bar.close()

    return step
