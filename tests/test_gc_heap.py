"""worker.gc_heap: a startup heap is collected, then frozen."""

from __future__ import annotations

import gc
import weakref

import pytest
from prometheus_client import CollectorRegistry

from worker.gc_heap import freeze_startup_heap, frozen_objects, watch_gc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def unfreeze_after():
    yield
    gc.unfreeze()  # this test process must go on collecting what it froze


def test_garbage_is_collected_before_the_heap_is_frozen(unfreeze_after):
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    alive = _Node()
    frozen = freeze_startup_heap("test")
    assert dead() is None, "garbage in a cycle was frozen instead of collected"
    # a frozen object freed by reference counting (another thread's, say) leaves the permanent
    # generation, and nothing joins it without another freeze: the live count can only fall
    assert frozen == frozen_objects() >= gc.get_freeze_count() > 0
    assert not any(o is alive for o in gc.get_objects())  # frozen: no generation tracks it now
    assert freeze_startup_heap("test again") >= frozen


def test_watch_gc_times_each_collection_by_generation(unfreeze_after):
    registry = CollectorRegistry()
    hooks = list(gc.callbacks)
    watch_gc(registry, {"process": "test"})
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        gc.callbacks[:] = hooks

    def count(generation: str) -> float:
        return registry.get_sample_value("graphfleet_gc_pause_seconds_count",
                                         {"process": "test", "generation": generation})

    assert count("2") >= 1 and count("0") >= 1
    assert registry.get_sample_value("graphfleet_gc_pause_seconds_sum", {"process": "test", "generation": "2"}) > 0
    frozen = freeze_startup_heap("test")  # the gauge reports the count this left, read when it froze
    assert registry.get_sample_value("graphfleet_gc_frozen_objects", {"process": "test"}) == frozen \
        >= gc.get_freeze_count() > 0  # the live count falls as frozen objects die (see above)
