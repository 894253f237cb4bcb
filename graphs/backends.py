"""Graph backends: how one shape of a forward is captured and replayed.

A backend captures a zero-argument callable ``fn`` that reads the runner's static inputs and writes
its static outputs; shapes, buffers and padding belong to the runner. Every CUDA backend captures
on the process capture stream into the process pool (:mod:`graphs.process`).

Warm-ups: a backend's first capture warms up outside the pool (whatever ``fn`` creates lazily on
its first runs, such as the capture stream's cuBLAS workspace, stays outside), and the blocks it
cached are given back before the capture grows the pool. Every later warm-up runs inside the pool
(``warm_up_in_pool``), on blocks earlier captures left free, so warm-ups never hold an activation
peak beside the graphs; one that leaves anything allocated there raises :class:`WarmUpLeakError`,
since a later replay would overwrite it.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from graphs.breakable import BreakableCapture, BreakableGraph, CaptureError, ForkTracker, unjoined_error
from graphs.capture_failures import offending_call, root_cause, sync_is_error
from graphs.piecewise import CompileClock, compile_clock
from graphs.process import allocations_in_pool, capture_stream, graph_pool, pool_usage, release_warm_up_memory


@dataclass
class CapturedShape:
    """One captured shape: resident bytes are the pool growth measured around its capture."""

    key: Hashable
    backend: str
    seconds: float
    resident_bytes: int
    num_segments: int = 1
    num_breaks: int = 0
    hits: int = 0
    artifact: object = field(default=None, repr=False)


class WarmUpLeakError(RuntimeError):
    """A warm-up inside the graph pool left memory allocated there: graph replays would overwrite
    it. Not a :class:`CaptureError`: running the shape eagerly would not take the block back."""


class GraphBackend(ABC):
    """Capture one shape of ``fn``; replay it; release everything."""

    name: str = "abstract"
    is_graph: bool = True  # whether a replay counts as a CUDA-graph pass

    def __init__(self, device: torch.device, warmup: int = 2,
                 barrier: Callable[[], None] | None = None, pool: tuple | None = None,
                 warm_up_in_pool: bool = True) -> None:
        self.device = device
        self.warmup = warmup
        self.barrier = barrier
        self._pool = pool
        self.warm_up_in_pool = warm_up_in_pool
        self.shapes: dict[Hashable, CapturedShape] = {}

    @property
    def pool(self) -> tuple:
        """The memory pool graphs are captured into: the process pool unless one was given."""
        return self._pool if self._pool is not None else graph_pool(self.device)

    def has(self, key: Hashable) -> bool:
        return key in self.shapes

    def capture(self, key: Hashable, fn: Callable[[], None], phase: str = "") -> CapturedShape:
        """Warm up ``fn`` on the capture stream, then capture it for ``key``.

        Raises :class:`CaptureError` naming the shape and the offending call on failure; nothing is
        recorded for ``key`` then. Resident bytes: the pool's growth over warm-up and capture.
        """
        start = time.perf_counter()
        try:
            before = self._warm_up_measured(key, fn, phase)
            artifact, segments, breaks = self._capture(fn)
        except WarmUpLeakError:
            raise
        except CaptureError as e:
            raise CaptureError(f"{phase} shape {key}: {e}") from e
        except Exception as e:  # noqa: BLE001 - any failure inside capture is reported with its call
            root = root_cause(e)
            raise CaptureError(f"capturing {phase} shape {key} with the {self.name} backend failed at "
                               f"{offending_call(root)}: {type(root).__name__}: {root}") from e
        shape = CapturedShape(key, self.name, time.perf_counter() - start, self._usage()[0] - before,
                              segments, breaks, artifact=artifact)
        self.shapes[key] = shape
        return shape

    def replay(self, key: Hashable) -> None:
        shape = self.shapes[key]
        shape.hits += 1
        self._replay(shape.artifact)

    def release_shape(self, key: Hashable) -> None:
        """Drop one captured shape (its pool blocks return to the pool for later captures)."""
        shape = self.shapes.pop(key, None)
        if shape is not None:
            self._release(shape.artifact)

    def release(self) -> None:
        """Drop every captured shape (graphs before the pool: see graphs/DESIGN.md)."""
        for shape in self.shapes.values():
            self._release(shape.artifact)
        self.shapes.clear()

    @property
    def resident_bytes(self) -> int:
        return sum(s.resident_bytes for s in self.shapes.values())

    def _usage(self) -> tuple[int, int]:
        """(reserved, allocated) bytes of this backend's pool, after the device is idle."""
        if self.device.type != "cuda":
            return 0, 0
        torch.cuda.synchronize(self.device)
        return pool_usage(self.pool, self.device)

    def _warm_up_measured(self, key: Hashable, fn: Callable[[], None], phase: str) -> int:
        """Warm ``fn`` up (see the module docstring: outside the pool on this backend's first
        capture, inside it after) and return the pool bytes the shape's growth counts from."""
        if self.device.type != "cuda":
            return 0
        if not (self.warm_up_in_pool and self.shapes):
            self._warm_up(fn, in_pool=False)
            release_warm_up_memory(self.device)  # before the capture grows the pool beside it
            return self._usage()[0]
        reserved, allocated = self._usage()
        self._warm_up(fn, in_pool=True)
        release_warm_up_memory(self.device)  # frees deferred by stream events are settled
        left = self._usage()[1] - allocated
        if left > 0:
            raise WarmUpLeakError(
                f"the warm-up of {phase} shape {key} ({self.name} backend) left {left} bytes allocated in the graph "
                "pool, on blocks that captured graphs use as scratch: something in the forward creates a buffer on a "
                "later run that its first run did not. Set graphs.warm_up_in_pool: false (warm-ups then run outside "
                "the pool, holding their own activation peak while graphs capture)")
        return reserved

    def _warm_up(self, fn: Callable[[], None], in_pool: bool, runs: int | None = None) -> None:
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for _ in range(self.warmup if runs is None else runs):
            if self.barrier is not None:
                self.barrier()  # outside the pool: a collective's own buffers are not the forward's
            with allocations_in_pool(self.pool, self.device) if in_pool else contextlib.nullcontext(), \
                    torch.cuda.stream(stream):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    @abstractmethod
    def _capture(self, fn: Callable[[], None]) -> tuple[object, int, int]:
        """Return (artifact, number of segments, number of breaks)."""

    @abstractmethod
    def _replay(self, artifact: object) -> None: ...

    def _release(self, artifact: object) -> None:  # noqa: B027 - only graph backends free anything
        return None


class _CudaGraphBackend(GraphBackend):
    """A backend whose artifact is a CUDA graph object (``replay()``, ``reset()``) recorded on the
    process capture stream: the capture preamble and the clean-up of a failed capture, shared."""

    def _capture(self, fn):
        if self.barrier is not None:
            self.barrier()
        graph = self._new_graph()
        try:
            self._record(graph, capture_stream(self.device), fn)
        except BaseException:
            graph.reset()
            raise
        torch.cuda.synchronize(self.device)
        return (graph, *self._structure(graph))

    @abstractmethod
    def _new_graph(self) -> object: ...

    @abstractmethod
    def _record(self, graph, stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
        """Record ``fn`` into ``graph`` on ``stream`` (raises on failure; the caller resets the graph)."""

    @abstractmethod
    def _structure(self, graph) -> tuple[int, int]:
        """(number of segments, number of breaks) of a recorded ``graph``."""

    def _replay(self, artifact):
        artifact.replay()

    def _release(self, artifact):
        artifact.reset()


class FullGraphBackend(_CudaGraphBackend):
    """One ``torch.cuda.CUDAGraph`` per shape; everything in ``fn`` must be graph-safe."""

    name = "full"

    def _new_graph(self):
        return torch.cuda.CUDAGraph()

    def _record(self, graph, stream, fn):
        with ForkTracker(stream) as forks, sync_is_error(self.device), \
                torch.cuda.graph(graph, pool=self.pool, stream=stream):
            try:
                fn()
            finally:
                unjoined = forks.join_all()  # before capture_end, whatever happened
        if unjoined:
            raise unjoined_error(unjoined, "the end of capture")

    def _structure(self, graph):
        return 1, 0


class BreakableGraphBackend(_CudaGraphBackend):
    """Graph segments around the ``@eager_break`` calls that ``fn`` makes."""

    name = "breakable"

    def _new_graph(self):
        return BreakableGraph()

    def _record(self, graph, stream, fn):
        with BreakableCapture(graph, self.pool, stream, self.barrier):
            fn()

    def _structure(self, graph):
        return len(graph.segments), len(graph.breaks)


class _CompileTimed(GraphBackend):
    """The compile/capture split of the ``tc_piecewise`` backends' captures.

    The first capture compiles (one compile serves every shape); ``compile_seconds`` and
    ``capture_seconds`` split this backend's capture wall time into the two.
    """

    name = "tc_piecewise"
    compile_seconds = 0.0  # class defaults: the first capture's += gives each instance its own
    capture_seconds = 0.0
    compiles = 0

    def capture(self, key: Hashable, fn: Callable[[], None], phase: str = "") -> CapturedShape:
        start = time.perf_counter()
        with compile_clock() as clock:
            try:
                shape = super().capture(key, fn, phase)
            finally:
                self.compile_seconds += clock.seconds
                self.compiles += clock.compiles
                self.capture_seconds += time.perf_counter() - start - clock.seconds
        self._count_pieces(shape, clock)
        return shape

    def _count_pieces(self, shape: CapturedShape, clock: CompileClock) -> None:
        """Set ``shape``'s segment and break counts where the capture itself does not."""

    def stats(self) -> dict[str, float | int]:
        """Compile and capture seconds spent in this backend's captures, compiles, shapes held.

        A compile triggered outside ``capture`` (the budget's eager timing of a shape) is not
        counted here; ``PiecewiseCompiled.compile_seconds`` counts every compile of a forward.
        """
        return {"compile_seconds": self.compile_seconds, "capture_seconds": self.capture_seconds,
                "compiles": self.compiles, "shapes": len(self.shapes)}


class TcPiecewiseBackend(_CompileTimed, BreakableGraphBackend):
    """Captures a ``torch.compile``d forward split at its opaque ops (:mod:`graphs.piecewise`), on CUDA.

    ``fn`` must call a :class:`graphs.piecewise.PiecewiseCompiled` forward whose splitting ops run
    ``@eager_break`` bodies (``worker.attention.splitting``). Each compiled piece is one graph
    segment per shape and the ops run eagerly between segments: the breakable capture (same pool,
    stream, boundary-buffer and fork contracts).
    """


class TcFullBackend(_CompileTimed, FullGraphBackend):
    """Captures a ``torch.compile``d forward as one full CUDA graph per shape, on CUDA.

    The same compile as ``tc_piecewise`` (:mod:`graphs.piecewise`: inductor pieces split at the
    opaque attention op, one compile for every shape >= 2), but the pieces and the ops between
    them are recorded into one graph: an op's ``@eager_break`` body runs inline outside a
    breakable capture (vLLM's FULL mode over its compiled model). Everything the ops do must be
    graph-safe, as for ``full``.
    """

    name = "tc_full"

    def _warm_up_measured(self, key: Hashable, fn: Callable[[], None], phase: str) -> int:
        # A shape may compile on its first run (the first shape; batch 1, which dynamo specializes), and a
        # compile's allocations must not land in the pool where later warm-ups run: one run outside it first.
        if self.device.type == "cuda" and self.warm_up_in_pool and self.shapes:
            self._warm_up(fn, in_pool=False, runs=1)
            release_warm_up_memory(self.device)
        return super()._warm_up_measured(key, fn, phase)


class TcPiecewiseNoGraphBackend(_CompileTimed):
    """``tc_piecewise`` off CUDA: the compiled pieces run without graphs (a replay calls ``fn``).

    Nothing is captured, so passes count as eager (reason ``tc_piecewise``); a shape's segment and
    break counts are the compiled forward's pieces and splits.
    """

    is_graph = False

    def _capture(self, fn):
        fn()  # compiles on the first shape, so capture time and compile time are known here too
        return fn, 0, 0

    def _replay(self, artifact):
        artifact()

    def _count_pieces(self, shape, clock):
        shape.num_segments, shape.num_breaks = clock.pieces, clock.splits


class TcFullNoGraphBackend(TcPiecewiseNoGraphBackend):
    """``tc_full`` off CUDA: the compiled forward runs without graphs (passes count as eager,
    reason ``tc_full``)."""

    name = "tc_full"


class DebugBackend(GraphBackend):
    """The whole forward as one eager break: no graph, but the runner's full replay path.

    Runs on any device, so CPU tests exercise static buffers, padding and metadata planning.
    """

    name = "debug"
    is_graph = False

    def _warm_up_measured(self, key, fn, phase):
        return 0

    def _capture(self, fn):
        return fn, 0, 1

    def _replay(self, artifact):
        artifact()


BACKENDS: dict[str, type[GraphBackend]] = {"full": FullGraphBackend, "breakable": BreakableGraphBackend,
                                           "tc_piecewise": TcPiecewiseBackend, "tc_full": TcFullBackend,
                                           "debug": DebugBackend}
OFF_CUDA: dict[str, type[GraphBackend]] = {"tc_piecewise": TcPiecewiseNoGraphBackend,
                                           "tc_full": TcFullNoGraphBackend, "debug": DebugBackend}


def compile_fallback(device: torch.device) -> str:
    """The backend a compiled backend's phase captures with once its compile failed: ``full`` on
    CUDA, ``debug`` (the runner path, no graph) off it."""
    return "full" if device.type == "cuda" else "debug"


def create_backend(name: str, device: torch.device, warmup: int = 2,
                   barrier: Callable[[], None] | None = None, pool: tuple | None = None,
                   warm_up_in_pool: bool = True) -> GraphBackend:
    """``full``, ``breakable``, ``tc_piecewise``, ``tc_full`` or ``debug`` (``eager`` is the eager
    runner: no backend).

    Off CUDA only ``debug``, ``tc_piecewise`` and ``tc_full`` (compiled, no graphs) exist.
    ``warm_up_in_pool``: see the module docstring.
    """
    if name not in BACKENDS:
        raise ValueError(f"graph backend {name!r}; allowed: {', '.join(BACKENDS)}")
    if device.type == "cuda":
        return BACKENDS[name](device, warmup, barrier, pool, warm_up_in_pool)
    if name not in OFF_CUDA:
        raise ValueError(f"graph backend {name!r} needs CUDA; on {device} use 'debug', 'tc_piecewise', "
                         "'tc_full' or 'eager'")
    return OFF_CUDA[name](device, warmup, barrier, pool, warm_up_in_pool)
