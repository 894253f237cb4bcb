"""The only process-wide singletons of graphfleet: one graph memory pool and one capture stream.

Every runner and backend of the process (decode and prefill, every shape) captures on the same
stream into the same pool. Sharing the pool lets graphs that never replay concurrently reuse
each other's scratch memory; sharing the stream matters because the caching allocator reuses a
freed block only on the stream it was allocated on, so per-capture streams would fragment the
shared pool.

Both are created lazily on first use, per device, and live as long as the process.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_lock = threading.RLock()
_pools: dict[int, tuple] = {}
_anchors: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
_streams: dict[int, torch.cuda.Stream] = {}


def _index(device: torch.device | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def graph_pool(device: torch.device | int | None = None) -> tuple:
    """The process's graph memory pool id for ``device`` (created on first call).

    A pool dies when the last graph captured into it is released, after which its id cannot be
    captured into again. A one-kernel *anchor* graph captured at creation and held here keeps
    the pool alive, so releasing every real graph (a re-plan, a test) leaves it usable.
    """
    idx = _index(device)
    with _lock:
        if idx not in _pools:
            with torch.cuda.device(idx):
                pool = torch.cuda.graph_pool_handle()
                anchor, scratch = torch.cuda.CUDAGraph(), torch.zeros(1, device=idx)
                stream = capture_stream(idx)
                stream.wait_stream(torch.cuda.current_stream(idx))
                with torch.cuda.graph(anchor, pool=pool, stream=stream):
                    scratch.add_(1)
                _pools[idx], _anchors[idx] = pool, (anchor, scratch)
        return _pools[idx]


def pool_bytes(pool: tuple, device: torch.device | int | None = None) -> int:
    """Bytes of device memory currently reserved by the graph pool ``pool`` (from the allocator)."""
    return pool_usage(pool, device)[0]


def pool_usage(pool: tuple, device: torch.device | int | None = None) -> tuple[int, int]:
    """(reserved, allocated) bytes of the graph pool ``pool``: what its segments hold, and what of
    that live tensors (static outputs, buffers created inside the pool) still occupy."""
    reserved = allocated = 0
    for segment in _segments(pool, _index(device)):
        reserved += segment["total_size"]
        allocated += segment["allocated_size"]
    return reserved, allocated


def _segments(pool: tuple, idx: int) -> list[dict]:
    """The allocator's segments of graph pool ``pool`` on device ``idx`` (a memory snapshot)."""
    return [segment for segment in torch.cuda.memory_snapshot()
            if segment.get("device") == idx and tuple(segment.get("segment_pool_id", ())) == tuple(pool)]


@contextlib.contextmanager
def allocations_in_pool(pool: tuple, device: torch.device | int | None = None):
    """Route the calling thread's CUDA allocations into the graph pool ``pool`` (outside capture).

    A warm-up run here draws its activations from the blocks earlier captures left free, and the
    capture that follows reuses the blocks the warm-up freed, so warm-up and graphs never hold
    the activation peak twice. Hazard: a block the pool has free is scratch of a captured graph,
    rewritten on every replay; whatever is allocated here must be freed before the next replay
    (:class:`graphs.backends.GraphBackend` checks that a warm-up leaves nothing allocated).
    """
    idx = _index(device)
    torch._C._cuda_beginAllocateCurrentThreadToPool(idx, pool)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(idx, pool)
        torch._C._cuda_releasePool(idx, pool)


def capture_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """The process's single capture stream for ``device`` (created on first call)."""
    idx = _index(device)
    with _lock:
        if idx not in _streams:
            _streams[idx] = torch.cuda.Stream(device=idx)
        return _streams[idx]


def release_warm_up_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the driver at the end of a capture pass
    (nothing to give back on a CPU device).

    A backend's first warm-up runs eagerly on the capture stream from the regular allocator (its
    later ones run in the pool: :func:`allocations_in_pool`). Blocks cached for that stream serve
    no later allocation (steps run on the compute stream, captures draw on the pool), so without
    this they stay reserved beside the graph pool: about one activation peak of the largest
    warm-up. Blocks of a live graph pool are never free to the allocator and are kept.
    """
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
