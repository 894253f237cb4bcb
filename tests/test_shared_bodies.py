"""Large request bodies read straight into the shared-memory segments the replica keeps (CPU).

The hostile-body test (tests/test_request_limits.py) shows what it is for: a 10 MB body answered
with the event loop free. These check the bookkeeping: the bytes arrive whole whichever path they
take, a segment is never handed out twice, and one goes back free however the request ends, but not
while a worker may still read it.
"""

from __future__ import annotations

import asyncio
import json
import os
from multiprocessing import shared_memory

import pytest

from deploy.preprocess_pool import Preprocessor
from deploy.shared_bodies import SHARED_BODY_BYTES, SharedBodies, SharedBody, read_body
from worker.admission import PromptLimits

LIMITS = PromptLimits(max_model_len=64, vocab_size=32000)
KEPT = 1 << 20


async def _chunks(data: bytes, size: int = 65536, fail_at: int | None = None):
    for at in range(0, len(data), size):
        if fail_at is not None and at >= fail_at:
            raise ConnectionResetError("the client went away")
        await asyncio.sleep(0)
        yield data[at:at + size]


def _data(n: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(n))


def _exists(name: str) -> bool:
    try:
        shared_memory.SharedMemory(name=name).close()
    except FileNotFoundError:
        return False
    return True


@pytest.fixture
def bodies():
    kept = SharedBodies(2, KEPT)
    yield kept
    kept.close()


def test_a_small_body_stays_bytes(bodies):
    data = _data(SHARED_BODY_BYTES)
    assert asyncio.run(read_body(_chunks(data), bodies)) == data
    assert bodies.take() is not None and bodies.take() is not None  # none was taken


def test_large_bodies_go_into_kept_segments_then_into_their_own(bodies):
    data = [_data(SHARED_BODY_BYTES + 1 + i) for i in range(3)]
    got = [asyncio.run(read_body(_chunks(d), bodies)) for d in data]
    assert [type(g) for g in got] == [SharedBody] * 3
    assert [g.kept for g in got] == [True, True, False]  # two kept segments, both held: the third its own
    assert len({g.name for g in got}) == 3
    for g, d in zip(got, data, strict=True):
        assert g.size == len(d) and bytes(g.segment.buf[:g.size]) == d
    assert bodies.take() is None
    own = got[2].name
    for g in got:
        bodies.give_back(g)
    assert not _exists(own)  # a body's own segment is removed once it is given back
    assert bodies.take() is not None and bodies.take() is not None and bodies.take() is None


def test_a_body_larger_than_a_kept_segment_moves_out_of_it_whole(bodies):
    data = _data(KEPT + 123)
    got = asyncio.run(read_body(_chunks(data, 100_000), bodies))
    assert isinstance(got, SharedBody) and not got.kept and bytes(got.segment.buf[:got.size]) == data
    bodies.give_back(got)
    assert bodies.take() is not None and bodies.take() is not None  # the one it started in is free again


def test_a_read_that_fails_frees_its_segment(bodies):
    data = _data(3 * SHARED_BODY_BYTES)
    with pytest.raises(ConnectionResetError):
        asyncio.run(read_body(_chunks(data, fail_at=2 * SHARED_BODY_BYTES), bodies))
    assert bodies.take() is not None and bodies.take() is not None


def test_kept_segments_are_removed_on_close_and_none_are_kept_where_shm_cannot_hold_them():
    kept = SharedBodies(1, KEPT)
    segment = kept.take()
    name = segment.name
    assert _exists(name)
    kept.free(segment)
    kept.close()
    assert not _exists(name) and kept.take() is None
    free = os.statvfs("/dev/shm")
    too_big = SharedBodies(1, free.f_bavail * free.f_frsize + (1 << 30))
    assert too_big.slots == 0 and too_big.take() is None  # no SIGBUS: the pages were reserved first
    got = asyncio.run(read_body(_chunks(_data(SHARED_BODY_BYTES * 2)), too_big))
    assert isinstance(got, SharedBody) and not got.kept  # served the slower way
    too_big.give_back(got)


@pytest.mark.timeout(120)
def test_the_pool_prepares_a_body_read_into_a_segment_and_frees_it_only_after_its_worker(checkpoint_dir):
    """Through a real worker: a body read into a kept segment prepares as its bytes do; a request
    cancelled while its worker parses a large body leaves the segment held until the worker is done."""
    pool = Preprocessor(str(checkpoint_dir("tiny-llama")), workers=1, max_body_bytes=16 << 20)
    assert pool.bodies.slots == 1
    ids = [5] * 60
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1, "pad": " " * (2 * SHARED_BODY_BYTES)}).encode()
    slow = json.dumps({"model": "m", "prompt": [1] * 4_000_000, "max_tokens": 1}).encode()  # 12 MB: a while
    try:
        async def scenario():
            read = await pool.read(_chunks(body))
            assert isinstance(read, SharedBody) and read.kept
            prepared = await pool.prepare("completions", read, LIMITS)
            assert prepared.prompts == [ids] == (await pool.prepare("completions", body, LIMITS)).prompts
            task = asyncio.ensure_future(pool.prepare("completions", await pool.read(_chunks(slow)), LIMITS))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.bodies.take() is None  # the worker still parses it
            for _ in range(200):
                await asyncio.sleep(0.05)
                segment = pool.bodies.take()
                if segment is not None:
                    pool.bodies.free(segment)
                    return
            raise AssertionError("the segment never came back")

        asyncio.run(scenario())
    finally:
        pool.shutdown()
