"""Cost of handing one step's events from the fleet loop thread to asyncio readers (host only).

A producer thread plays the fleet loop: every ``--step-ms`` it puts one event into each of N
``EventSink``s, as a decode step does for N streams; N asyncio readers on one event loop (the
Serve replica's) await them. Measured with the wake-ups sent per event (``immediate``) and
batched per step (``deferred``, what ``FleetLoop`` does): the producer's time per step spent
delivering (time the loop thread is not stepping), the steps that ran late, and the reader's
latency from put to receipt. Runs anywhere; usage: ``python bench/event_delivery.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, print_table, write_results  # noqa: E402
from fleet.request import EventSink, Wakeups  # noqa: E402


def run(readers: int, steps: int, step_s: float, deferred: bool) -> dict:
    wakeups = Wakeups() if deferred else None
    sinks = [EventSink(wakeups) for _ in range(readers)]
    deliver_s: list[float] = []
    latency_s: list[float] = []

    async def read(sink: EventSink) -> None:
        for _ in range(steps):
            sent = await sink.aget(timeout=30.0)
            latency_s.append(time.perf_counter() - sent)

    def produce() -> None:
        next_step = time.perf_counter()
        for _ in range(steps):
            next_step += step_s
            time.sleep(max(0.0, next_step - time.perf_counter()))  # the GPU step
            t = time.perf_counter()
            if wakeups is not None:
                with wakeups.deferred():
                    for s in sinks:
                        s.put(time.perf_counter())
            else:
                for s in sinks:
                    s.put(time.perf_counter())
            deliver_s.append(time.perf_counter() - t)

    async def main() -> float:
        tasks = [asyncio.create_task(read(s)) for s in sinks]
        await asyncio.sleep(0.05)  # every reader waits before the first step
        start = time.perf_counter()
        producer = threading.Thread(target=produce)
        producer.start()
        await asyncio.gather(*tasks)
        producer.join()
        return time.perf_counter() - start

    wall = asyncio.run(main())
    latency_s.sort()
    return {"readers": readers, "wake_ups": "deferred" if deferred else "immediate",
            "deliver_ms_p50": statistics.median(deliver_s) * 1e3,
            "deliver_ms_p99": sorted(deliver_s)[int(0.99 * (len(deliver_s) - 1))] * 1e3,
            "wall_over_steps": wall / (steps * step_s),
            "latency_ms_p50": latency_s[len(latency_s) // 2] * 1e3,
            "latency_ms_p99": latency_s[int(0.99 * (len(latency_s) - 1))] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--step-ms", type=float, default=3.0, help="time between steps (a decode step)")
    args = ap.parse_args()
    rows = [run(n, args.steps, args.step_ms / 1e3, deferred) for n in map(int, args.readers.split(","))
            for deferred in (False, True)]
    print_table(rows, list(rows[0]))
    print(f"wrote {write_results('event_delivery', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
