"""Breakable CUDA graphs: graph segments around explicit eager breaks.

A function decorated with :func:`eager_break` runs normally outside capture. While a
:class:`BreakableCapture` is active, calling it closes the current graph segment, runs the
function eagerly once, records it for replay and opens a new segment. Replay of a
:class:`BreakableGraph` runs ``segment[0], break[0], segment[1], ..., segment[n]`` in capture
order.

Contracts, checked at capture with errors that say how to fix them:

* An eager function writes its results into tensors passed as arguments and returns ``None``
  (or non-tensor values); returning a CUDA tensor raises. Those argument tensors are the
  *boundary buffers*: their addresses are baked into the neighbouring segments, and replay
  writes them in place.
* Side streams forked from the capture stream are joined back before a break and before the
  end of capture (an unjoined fork raises, naming the fix).
* Captures do not nest.

Arguments are held through non-owning aliases, so a break does not keep capture-time
temporaries alive; their memory belongs to the shared graph pool, whose blocks stay reserved
while any graph captured into it is alive, and replay order equals capture order.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

_active: contextvars.ContextVar[BreakableCapture | None] = contextvars.ContextVar("breakable_capture", default=None)


class CaptureError(RuntimeError):
    """A graph capture that cannot succeed; the message names the shape, the call and the fix."""


def _weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory without owning it (CUDA only; CPU tensors pass through)."""
    if not t.is_cuda:
        return t
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def _alias_args(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _weak_alias(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_alias_args(v) for v in value)
    if isinstance(value, dict):
        return {k: _alias_args(v) for k, v in value.items()}
    return value


def _contains_cuda_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, (list, tuple)):
        return any(_contains_cuda_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_contains_cuda_tensor(v) for v in value.values())
    return False


class ForkTracker:
    """While active, records side streams forked from (and joined back to) ``stream``.

    An unjoined fork makes ``capture_end`` fail inside PyTorch before it stops routing
    allocations to the graph pool, which poisons every later capture in the process. Knowing the
    forks lets a capture join them itself, end cleanly, and then report the error. Tracks
    ``Stream.wait_stream`` (forks made only through raw events are not seen).
    """

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._forks: dict[int, torch.cuda.Stream] = {}
        self._original = None

    def __enter__(self) -> ForkTracker:
        original = self._original = torch.cuda.Stream.wait_stream
        tracker = self

        def wait_stream(stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
            if other == tracker.stream and stream != tracker.stream:
                tracker._forks[stream.stream_id] = stream
            elif stream == tracker.stream:
                tracker._forks.pop(other.stream_id, None)
            return original(stream, other)

        torch.cuda.Stream.wait_stream = wait_stream
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.Stream.wait_stream = self._original

    def join_all(self) -> int:
        """Join every still-forked side stream back into ``stream``; returns how many there were."""
        n = len(self._forks)
        for side in self._forks.values():
            self._original(self.stream, side)
        self._forks.clear()
        return n


def unjoined_error(count: int, where: str) -> CaptureError:
    return CaptureError(
        f"{count} side stream(s) forked from the capture stream were not joined before {where}: "
        "call capture_stream.wait_stream(side_stream) after the side-stream work")


class BreakableGraph:
    """Captured segments and the eager calls between them; ``len(segments) == len(breaks) + 1``."""

    def __init__(self) -> None:
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[Callable[[], None]] = []

    def replay(self) -> None:
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < len(self.breaks):
                self.breaks[i]()

    def reset(self) -> None:
        for segment in self.segments:
            segment.reset()
        self.segments.clear()
        self.breaks.clear()


class BreakableCapture:
    """Context manager capturing a :class:`BreakableGraph` on ``stream`` into ``pool``.

    ``barrier`` (optional) runs before every break during capture, so tensor-parallel ranks
    enter each eager call together.
    """

    def __init__(self, graph: BreakableGraph, pool: tuple, stream: torch.cuda.Stream,
                 barrier: Callable[[], None] | None = None) -> None:
        self.graph, self.pool, self.stream, self.barrier = graph, pool, stream, barrier
        self._segment: torch.cuda.CUDAGraph | None = None
        self._stream_ctx = None
        self._token = None
        self._forks = ForkTracker(stream)

    def __enter__(self) -> BreakableCapture:
        if _active.get() is not None:
            raise CaptureError("nested capture: a breakable capture is already active in this context; "
                               "finish it before starting another")
        torch.cuda.synchronize(self.stream.device)
        self._stream_ctx = torch.cuda.stream(self.stream)
        self._stream_ctx.__enter__()
        self._token = _active.set(self)
        self._forks.__enter__()
        try:
            self._begin_segment()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._end_segment("the end of capture")
            else:
                self._abort_segment()
        finally:
            self._leave()

    def _leave(self) -> None:
        self._forks.__exit__(None, None, None)
        _active.reset(self._token)
        self._stream_ctx.__exit__(None, None, None)

    def _begin_segment(self) -> None:
        self._segment = torch.cuda.CUDAGraph()
        # Host syncs raise before reaching CUDA while a segment records (see capture_failures.sync_is_error).
        self._sync_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._segment.capture_begin(pool=self.pool)
        except BaseException:
            self._segment = None
            torch.cuda.set_sync_debug_mode(self._sync_mode)
            raise

    def _end_segment(self, where: str) -> None:
        segment, self._segment = self._segment, None
        torch.cuda.set_sync_debug_mode(self._sync_mode)
        unjoined = self._forks.join_all()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            segment.capture_end()
        if unjoined:
            raise unjoined_error(unjoined, where)
        self.graph.segments.append(segment)

    def _abort_segment(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            torch.cuda.set_sync_debug_mode(self._sync_mode)
            self._forks.join_all()
            with contextlib.suppress(RuntimeError):
                segment.capture_end()  # ends the stream's capture mode; the segment is discarded

    def run_break(self, fn: Callable, stub: Callable | None, args: tuple, kwargs: dict) -> Any:
        name = getattr(fn, "__qualname__", repr(fn))
        self._end_segment(f"the eager break '{name}'")
        if self.barrier is not None:
            self.barrier()
        result = (stub or fn)(*args, **kwargs)
        if _contains_cuda_tensor(result):
            self._begin_segment()  # keep the capture state consistent for the caller's cleanup
            raise CaptureError(
                f"eager break '{name}' returned a CUDA tensor; its address would change on every replay. "
                "Write the result into a buffer passed as an argument and return None instead")
        weak_args, weak_kwargs = _alias_args(args), _alias_args(kwargs)
        inference = torch.is_inference_mode_enabled()

        def replay_break() -> None:
            # Boundary buffers made under inference mode may only be written under it.
            with torch.inference_mode(inference):
                fn(*weak_args, **weak_kwargs)

        self.graph.breaks.append(replay_break)
        self._begin_segment()
        return result


def eager_break(fn: Callable | None = None, *, capture_stub: Callable | None = None):
    """Mark ``fn`` as an eager break (SGLang: ``@eager_on_graph``).

    ``capture_stub`` is a cheap stand-in run only while capturing (same signature); replay
    always runs ``fn``.
    """
    def wrap(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            capture = _active.get()
            if capture is None:
                return f(*args, **kwargs)
            return capture.run_break(f, capture_stub, args, kwargs)

        wrapper.is_eager_break = True
        return wrapper

    return wrap(fn) if fn is not None else wrap
