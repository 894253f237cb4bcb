"""Freezing a long-lived process's startup heap for the garbage collector.

A full (generation 2) collection scans every object the collector tracks. A process that has
built an Engine for tiny-llama tracks about 230,000 of them (torch, Ray, pydantic, the model,
the runners), and a full collection there took 115-127 ms on the 2-core CPU machine. Serving
may trigger such collections, each a stall of the thread that triggers it: a group's engine loop
between two steps, or the replica's event loop (:func:`watch_gc` measures them). ``gc.freeze``
moves everything alive into a permanent generation that collections skip (a full collection
then took 0.01 ms). vLLM does the same in its engine and API server after warm-up
(``freeze_gc_heap``).

Hazard: frozen objects are never collected again, so garbage in reference cycles among them
leaks (objects freed by reference counting are unaffected). :func:`freeze_startup_heap`
collects first, and is called only where the process lives as long as what it freezes: a rank
actor once its generation has captured (one generation per actor process) and the Serve replica
once its fleet is up; never in a test process or a library caller's.

The module's one piece of state is the count the process's last :func:`freeze_startup_heap` left
frozen, which ``graphfleet_gc_frozen_objects`` reports: ``gc.get_freeze_count()`` walks every frozen
object with the GIL held (16 ms for 520,000 objects on the 2-core CPU machine), which every scrape
of every process paid, stalling its event loop or engine loop for that long. Frozen objects that
die by reference counting leave the permanent generation, so the gauge may read a little above
``gc.get_freeze_count()``: it is the count at the freeze.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

_frozen_at_last_freeze = 0  # gc.get_freeze_count() when freeze_startup_heap last returned


def freeze_startup_heap(context: str) -> int:
    """Collect every generation, then freeze what is alive; returns the objects frozen in all.

    Call it again after more startup work: what the earlier call froze stays frozen.
    """
    global _frozen_at_last_freeze
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = _frozen_at_last_freeze = gc.get_freeze_count()
    log.info("%s: %d objects frozen for the garbage collector in %.0f ms (collections skip them)",
             context, frozen, (time.perf_counter() - start) * 1e3)
    return frozen


def frozen_objects() -> float:
    """Objects frozen when this process last called :func:`freeze_startup_heap` (0: never; a gauge's
    value, read without walking the frozen objects). A freeze by someone else (Ray Serve's replica
    freezes after its constructor) shows from the next call on."""
    return float(_frozen_at_last_freeze)


def watch_gc(registry, labels: dict[str, str]) -> None:
    """Register ``graphfleet_gc_frozen_objects`` and ``graphfleet_gc_pause_seconds{generation}``
    (every collection this process runs, timed by a ``gc.callbacks`` hook) in ``registry``, with
    constant ``labels``. Once per long-lived process: each call adds a hook for good."""
    from prometheus_client import Gauge, Histogram

    names = list(labels)
    Gauge("graphfleet_gc_frozen_objects", "Objects the process froze for the garbage collector after its "
          "start (full collections skip them)", names, registry=registry,
          ).labels(**labels).set_function(frozen_objects)
    pauses = Histogram("graphfleet_gc_pause_seconds", "Garbage collections of the process by generation "
                       "(2 = full), each a stall of the thread that triggered it", [*names, "generation"],
                       buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
                       registry=registry)
    by_generation = [pauses.labels(**labels, generation=str(g)) for g in range(3)]
    started = [0.0]

    def hook(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started[0])

    gc.callbacks.append(hook)
