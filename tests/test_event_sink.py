"""EventSink: the fleet loop thread hands each request's events to a blocking or an asyncio reader."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from fleet.handle import RequestHandle
from fleet.request import EventSink, FleetRequest, Wakeups
from worker.outputs import RequestEvent
from worker.sampling.params import SamplingParams


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


def _event(i: int, finished: bool = False) -> RequestEvent:
    return RequestEvent("r", [i], f"t{i}", finished, "length" if finished else None)


def test_hold_ignores_tokens_and_ends_at_the_final_event():
    sink = EventSink()

    async def hold_while(puts: list[tuple[float, RequestEvent]], hold_s: float) -> tuple[float, list]:
        sink.put(_event(0))
        assert (await sink.aget(timeout=1.0)).token_ids == [0]  # the reader's loop is registered
        for delay, ev in puts:
            threading.Timer(delay, sink.put, args=(ev,)).start()
        t = time.monotonic()
        await sink.ahold(hold_s)
        held = time.monotonic() - t
        await asyncio.sleep(0.05)  # timers of the same instant have put
        return held, sink.drain()

    held, items = asyncio.run(hold_while([(0.01 * i, _event(i)) for i in range(1, 10)], 0.4))
    assert held >= 0.35  # nine tokens arrived during the hold and none woke it
    assert [e.token_ids[0] for e in items] == list(range(1, 10))
    assert sink.drain() == []

    held, items = asyncio.run(hold_while([(0.02, _event(1)), (0.1, _event(2, finished=True))], 5.0))
    assert held < 1.0  # the final event ends the hold
    assert [e.finished for e in items] == [False, True]

    async def after_final() -> float:  # the final item is already there: no wait at all
        t = time.monotonic()
        await sink.ahold(5.0)
        return time.monotonic() - t

    assert asyncio.run(after_final()) < 0.5


def test_event_batches_first_at_once_then_per_interval_and_final_at_once():
    """RequestHandle.aevent_batches: the first event goes alone; tokens then wait for the interval
    unless the final event comes first. The test thread plays the fleet loop (the sink's producer)."""
    request = FleetRequest("r", [1, 2, 3], SamplingParams(max_tokens=8), 0, None)
    handle = RequestHandle(None, request)

    def produce() -> None:
        for i in range(1, 6):
            request.deliver(_event(i))
        time.sleep(0.1)
        request.finish("length", event=_event(6, finished=True))

    async def read() -> list[tuple[float, list[int]]]:
        got = []
        request.deliver(_event(0))
        t = time.monotonic()
        async for batch in handle.aevent_batches(interval_s=2.0, wait_s=5.0):
            got.append((time.monotonic() - t, [e.token_ids[0] for e in batch]))
            if len(got) == 1:
                threading.Thread(target=produce, daemon=True).start()
        return got

    got = asyncio.run(read())
    assert [ids for _, ids in got] == [[0], [1, 2, 3, 4, 5, 6]]
    assert got[0][0] < 0.5 and got[1][0] < 1.5  # neither waited for the 2 s interval
    assert handle.finished and asyncio.run(handle.aresult(wait_s=1.0)).token_ids == list(range(7))
