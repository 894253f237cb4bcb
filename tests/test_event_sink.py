"""EventSink: the fleet loop thread hands each request's events to a blocking or an asyncio reader."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from cluster.fleet_request import EventSink, Wakeups


def _produce(sink: EventSink, n: int, pause_every: int) -> threading.Thread:
    def run() -> None:
        for i in range(n):
            sink.put(i)
            if i % pause_every == 0:
                time.sleep(0.0005)  # let the reader catch up and wait again: exercises every interleaving

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_async_reader_gets_every_item_in_order_without_lost_wakeups():
    sink, n = EventSink(), 20_000

    async def read() -> list[int]:
        producer = _produce(sink, n, pause_every=7)
        got = [await sink.aget(timeout=2.0) for _ in range(n)]  # a lost wake-up would raise queue.Empty
        producer.join(5)
        return got

    assert asyncio.run(read()) == list(range(n))


def test_many_async_readers_share_one_loop():
    sinks = [EventSink() for _ in range(64)]

    async def read(sink: EventSink) -> list[int]:
        return [await sink.aget(timeout=2.0) for _ in range(200)]

    async def main() -> list[list[int]]:
        readers = [asyncio.create_task(read(s)) for s in sinks]
        await asyncio.sleep(0)  # every reader is waiting before anything is put

        def produce() -> None:
            for i in range(200):
                for s in sinks:
                    s.put(i)

        threading.Thread(target=produce, daemon=True).start()
        return await asyncio.gather(*readers)

    assert asyncio.run(main()) == [list(range(200))] * 64


def test_async_wait_is_bounded():
    sink = EventSink()

    async def read() -> float:
        t = time.monotonic()
        with pytest.raises(queue.Empty):
            await sink.aget(timeout=0.2)
        return time.monotonic() - t

    assert 0.15 < asyncio.run(read()) < 2.0


def test_blocking_reader_and_put_after_the_async_readers_loop_closed():
    sink = EventSink()

    async def first() -> int:
        threading.Timer(0.05, sink.put, args=(1,)).start()
        return await sink.aget(timeout=2.0)

    assert asyncio.run(first()) == 1
    sink.put(2)  # the loop that waited before is closed: the put must not raise
    assert sink.get(timeout=1.0) == 2
    with pytest.raises(queue.Empty):
        sink.get(timeout=0.05)


def _delay_to_reader(hold_s: float, use_flush: bool) -> float:
    """Seconds from a put made inside ``Wakeups.deferred()`` until the reader has it, when the
    producer holds the block open ``hold_s`` (flushing right after the put if ``use_flush``)."""
    wakeups = Wakeups()
    sink = EventSink(wakeups)
    sent: list[float] = []

    def produce() -> None:
        with wakeups.deferred():
            with wakeups.deferred():  # nested: only the outer block flushes
                sent.append(time.monotonic())
                sink.put("event")
                if use_flush:
                    wakeups.flush()
            time.sleep(hold_s)

    async def read() -> float:
        reader = asyncio.create_task(sink.aget(timeout=5.0))
        await asyncio.sleep(0.05)  # the reader is waiting before the put
        threading.Thread(target=produce, daemon=True).start()
        assert await reader == "event"
        return time.monotonic() - sent[0]

    return asyncio.run(read())


def test_deferred_wakeups_reach_readers_at_the_flush():
    assert _delay_to_reader(0.3, use_flush=False) >= 0.25  # woken when the outer block ends
    assert _delay_to_reader(0.3, use_flush=True) < 0.2  # flush() wakes at once
