"""Large request bodies, read from the socket straight into shared memory the replica keeps.

A body over :data:`SHARED_BODY_BYTES` goes to a preprocessing worker in shared memory (through the
pool's pipe a 10 MB body took 0.25-0.3 s of both processes). Creating a segment per body, and
joining the body's chunks into one ``bytes`` before copying it there, made the replica's event
loop write every page of two fresh 10 MB regions: on the 2-core CPU machine (a virtual machine
whose memory the host backs as it is first touched) a 10 MB body then held the loop 45-700 ms,
and ``/health`` answered in 150-215 ms where the limit is 100 ms. So the replica keeps a few
segments of ``serve.max_request_bytes`` each for its whole life, written through once when it
starts (their pages are resident from then on), and :func:`read_body` writes a large body's
chunks into a free one as they arrive: about 1 ms of the loop per 10 MB.

A body for which no segment is free (every one holds a body a worker has not finished with) is
read into memory and handed over in a segment of its own, as before: slower, never refused.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing import shared_memory

log = logging.getLogger("ray.serve").getChild("graphfleet")

__all__ = ["SHARED_BODY_BYTES", "SharedBodies", "SharedBody", "read_body"]

#: Bodies larger than this go to a pool worker in shared memory instead of through the pool's pipe.
SHARED_BODY_BYTES = 256 * 1024
_PAGE_RUN = 1 << 20  # bytes written at a time when a segment is first written through


@dataclass(eq=False)
class SharedBody:
    """A body of ``size`` bytes at the start of shared-memory ``segment``; a worker reads it by
    (:attr:`name`, ``size``). Give it back with :meth:`SharedBodies.give_back` once no worker reads it."""

    size: int
    segment: shared_memory.SharedMemory = field(repr=False)
    kept: bool  # one of the replica's kept segments (else made for this body alone, unlinked after)

    @property
    def name(self) -> str:
        """The segment's name, by which a worker attaches to it."""
        return self.segment.name


class SharedBodies:
    """``slots`` shared-memory segments of ``size`` bytes each, made and written through now.

    Where ``/dev/shm`` cannot hold them (a container's default 64 MiB, say) fewer are kept, with a
    warning, and the bodies that find none free take the slower path. Thread-safe: a slot goes back
    from whichever thread sees its worker finish.
    """

    def __init__(self, slots: int, size: int) -> None:
        self.size = size
        self._free: list[shared_memory.SharedMemory] = []
        self._all: list[shared_memory.SharedMemory] = []
        self._lock = threading.Lock()
        for _ in range(slots):
            segment = _kept_segment(size)
            if segment is None:
                break
            self._all.append(segment)
            self._free.append(segment)

    @property
    def slots(self) -> int:
        """How many segments are kept."""
        return len(self._all)

    def take(self) -> shared_memory.SharedMemory | None:
        """A free kept segment, or None when every one holds a body."""
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, segment: shared_memory.SharedMemory) -> None:
        """A kept segment taken with :meth:`take` is free again (after :meth:`close`, nothing)."""
        with self._lock:
            if any(segment is kept for kept in self._all):
                self._free.append(segment)

    def give_back(self, body: SharedBody) -> None:
        """Done with ``body``: its kept segment is free again, a segment of its own is removed."""
        if body.kept:
            self.free(body.segment)
        else:
            body.segment.close()
            body.segment.unlink()

    def one_off(self, data: bytes) -> SharedBody:
        """``data`` in a segment made for it alone (unlinked by :meth:`give_back`)."""
        segment = shared_memory.SharedMemory(create=True, size=len(data))
        segment.buf[:len(data)] = data
        return SharedBody(len(data), segment, kept=False)

    def close(self) -> None:
        """Remove every kept segment (the replica is ending; no worker reads them any more)."""
        with self._lock:
            segments, self._all, self._free = self._all, [], []
        for segment in segments:
            segment.close()
            segment.unlink()


def _kept_segment(size: int) -> shared_memory.SharedMemory | None:
    segment = shared_memory.SharedMemory(create=True, size=size)
    try:
        # Reserve the pages first: writing to a tmpfs that is full raises SIGBUS, this ENOSPC.
        os.posix_fallocate(segment._fd, 0, size)
    except (OSError, AttributeError) as e:
        log.warning("kept no shared memory segment of %d bytes for large request bodies (%s): such bodies "
                    "take a segment made for each one, which costs the event loop more", size, e)
        segment.close()
        segment.unlink()
        return None
    zeros = bytes(min(size, _PAGE_RUN))
    for at in range(0, size, _PAGE_RUN):  # map every page into this process now, not under a request
        n = min(_PAGE_RUN, size - at)
        segment.buf[at:at + n] = zeros[:n]
    return segment


async def read_body(chunks: AsyncIterator[bytes], bodies: SharedBodies) -> bytes | SharedBody:
    """The whole body from ``chunks``: ``bytes`` up to :data:`SHARED_BODY_BYTES`, else a
    :class:`SharedBody` (a kept segment the chunks were written into as they came, or, with none
    free or the body larger than one, a segment of its own). Whatever ends the read early (the
    client gone, a cancellation) frees a taken segment before it is raised."""
    pieces: list[bytes] = []
    size = 0
    segment: shared_memory.SharedMemory | None = None
    in_memory = False  # no kept segment was free, or the body outgrew one: read as before
    try:
        async for chunk in chunks:
            end = size + len(chunk)
            if segment is None and not in_memory and end > SHARED_BODY_BYTES:
                segment = bodies.take() if end <= bodies.size else None
                in_memory = segment is None
                if segment is not None:
                    segment.buf[:size] = b"".join(pieces)
                    pieces = []
            elif segment is not None and end > bodies.size:
                pieces = [bytes(segment.buf[:size])]
                bodies.free(segment)
                segment, in_memory = None, True
            if segment is not None:
                segment.buf[size:end] = chunk
            else:
                pieces.append(chunk)
            size = end
    except BaseException:
        if segment is not None:
            bodies.free(segment)
        raise
    if segment is not None:
        return SharedBody(size, segment, kept=True)
    data = b"".join(pieces)
    return data if size <= SHARED_BODY_BYTES else bodies.one_off(data)
