"""worker.gc_heap: a startup heap is collected, then frozen."""

from __future__ import annotations

import gc
import weakref

import pytest

from worker.gc_heap import freeze_startup_heap, frozen_objects


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
    assert frozen == gc.get_freeze_count() == frozen_objects() > 0
    assert not any(o is alive for o in gc.get_objects())  # frozen: no generation tracks it now
    assert freeze_startup_heap("test again") >= frozen
