"""The one-block layout: how large a single free block must be for a recorded allocation sequence to
lay out inside it, placed as the CUDA caching allocator places requests in a block it already has.

``graphs.pool_layout: presized`` gives the graph pool one free block as a backend's first capture begins
(graphs/DESIGN.md, "How the pool grows"). A capture makes the same requests each time it is recorded, so
the block is sized by replaying the requests of a trial capture here, not by a peak: a live peak is a
lower bound that best fit rarely reaches, and a block too short is worse than none (a request that no
free part fits grows the pool by a segment of its own beside the block).

The rules replayed (PyTorch's ``CUDACachingAllocator``, large pool, one stream): a request is rounded up
to 512 bytes; it takes the smallest free block that fits (the lowest address among equals); the block
is split, the request at its front, when more than 1 MiB would remain (else the request takes the
whole block); a freed block merges with free neighbours. Requests of at most 1 MiB live in the small
pool's own 2 MiB segments and never in the block, so they are left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch

from graphs import process

#: The caching allocator's request rounding, its small-request limit and its large segments' granule.
ROUND_BYTES = 512
SMALL_REQUEST = 1 << 20
GRANULE = 2 << 20
#: How many granules above the unbounded replay's high-water mark a block is tried at before giving up.
MAX_EXTRA_GRANULES = 64

Event = tuple[str, int, int]  # ("alloc" | "free", address, bytes)


def rounded(nbytes: int) -> int:
    """``nbytes`` as the caching allocator rounds a request."""
    return max(ROUND_BYTES, -(-nbytes // ROUND_BYTES) * ROUND_BYTES)


class _Block:
    """Free and allocated ranges of one block of ``size`` bytes (offsets from its start)."""

    def __init__(self, size: int) -> None:
        self.free = {0: size}  # offset -> bytes
        self.free_ending = {size: 0}  # end offset -> offset of the free range ending there
        self.taken: dict[int, int] = {}
        self.high_water = 0

    def allocate(self, nbytes: int) -> int | None:
        fits = [(size, offset) for offset, size in self.free.items() if size >= nbytes]
        if not fits:
            return None
        size, offset = min(fits)
        self._unfree(offset)
        if size - nbytes > SMALL_REQUEST:
            self._refree(offset + nbytes, size - nbytes)
            size = nbytes
        self.taken[offset] = size
        self.high_water = max(self.high_water, offset + size)
        return offset

    def release(self, offset: int) -> None:
        size = self.taken.pop(offset)
        after = self.free.get(offset + size)
        if after is not None:
            self._unfree(offset + size)
            size += after
        before = self.free_ending.get(offset)
        if before is not None:
            size += self.free[before]
            self._unfree(before)
            offset = before
        self._refree(offset, size)

    def _unfree(self, offset: int) -> None:
        del self.free_ending[offset + self.free.pop(offset)]

    def _refree(self, offset: int, size: int) -> None:
        self.free[offset] = size
        self.free_ending[offset + size] = offset


def replay(events: Iterable[Event], size: int) -> int | None:
    """Lay ``events`` out in one block of ``size`` bytes; the high-water mark, or None when a request
    found no free range (frees of addresses the events never allocated are ignored)."""
    block, at = _Block(size), {}
    for kind, addr, nbytes in events:
        if kind == "alloc":
            offset = block.allocate(rounded(nbytes))
            if offset is None:
                return None
            at[addr] = offset
        elif addr in at:
            block.release(at.pop(addr))
    return block.high_water


def one_block_bytes(events: Sequence[Event]) -> int:
    """The fewest bytes, in whole 2 MiB granules, of one free block in which ``events`` (large
    requests only) lay out with no request left over; 0 when there is nothing to lay out or no size
    up to :data:`MAX_EXTRA_GRANULES` above the unbounded replay's high-water mark fits (best fit is
    not monotonic in the block's size: a smaller tail can draw a request an unbounded one would not)."""
    events = [e for e in events if e[0] != "alloc" or e[2] > SMALL_REQUEST]
    unbounded = replay(events, 1 << 62)
    if not unbounded:
        return 0
    first = -(-unbounded // GRANULE) * GRANULE
    for size in range(first, first + MAX_EXTRA_GRANULES * GRANULE + 1, GRANULE):
        if replay(events, size) is not None:
            return size
    return 0


def _history_enabled() -> bool:
    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(probe()) if probe is not None else False


def _trace(index: int) -> list[dict]:
    traces = torch.cuda.memory._snapshot()["device_traces"]
    return traces[index] if index < len(traces) else []


@contextlib.contextmanager
def recorded_allocations(device: torch.device, stream: torch.cuda.Stream):
    """Record the allocator's requests on ``stream`` while the body runs: yields a callable that,
    after the body, returns them as ``(kind, address, bytes)`` events (allocations and completed
    frees, in order). Uses the allocator's history (``torch.cuda.memory._record_memory_history``,
    without stack frames); a recording already running is read, not stopped."""
    events: list[Event] = []
    index = device.index if device.index is not None else torch.cuda.current_device()
    running = _history_enabled()
    if not running:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", clear_history=True)
    start = len(_trace(index)) if running else 0
    try:
        yield lambda: events
        torch.cuda.synchronize(device)
        kinds = {"alloc": "alloc", "free_completed": "free"}
        events.extend((kinds[e["action"]], e["addr"], e["size"]) for e in _trace(index)[start:]
                      if e.get("action") in kinds and e.get("stream") == stream.cuda_stream)
    finally:
        if not running:
            torch.cuda.memory._record_memory_history(None)


def block_for(pool: tuple, device: torch.device, capture_into: Callable[[tuple], Callable[[], None]]) -> int:
    """The free block a backend's first capture begins by giving ``pool``
    (:func:`graphs.process.after_free_block`). ``capture_into(trial)`` captures the shape once into a
    fresh pool of its own and returns what releases that capture; the requests that trial capture
    made in its pool, laid out in one block as the real capture will lay them out, size the block.
    Its own capture, not an eager run: whatever the capture keeps (or frees later) the eager forward
    need not. The trial pool is given back before the real capture. 0 when ``pool`` already has a
    free block that large."""
    trial = torch.cuda.graph_pool_handle()
    with recorded_allocations(device, process.capture_stream(device)) as events:
        release = capture_into(trial)
        ranges = process.segment_ranges(trial, device)
    release()
    process.release_warm_up_memory(device)
    inside = [e for e in events() if any(start <= e[1] < end for start, end in ranges)]
    return process.presize_bytes(pool, device, one_block_bytes(inside))
