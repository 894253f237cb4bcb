"""Page accounting checks shared by the prefix-caching tests."""

from __future__ import annotations

from worker.engine import Engine
from worker.prefix_cache import PrefixCachePool


def assert_all_pages_back(engine: Engine, free: int) -> None:
    """Nothing in flight or unfinished, ``free`` pages free again, no page held for an in-flight step,
    and (with prefix caching) every page's refcount back to 0."""
    pool = engine.allocator
    assert not engine.in_flight and not engine.has_unfinished()
    assert engine.num_free_pages == free and not pool.take_held()
    if isinstance(pool, PrefixCachePool):
        assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))
