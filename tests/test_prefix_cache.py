"""The prefix-cache page pool (worker/prefix_cache.py): refcounts, keys, LRU eviction, the hold protocol."""

from __future__ import annotations

import random

import pytest

from worker.kv_cache import OutOfPages
from worker.prefix_cache import PrefixCachePool
from worker.prefix_hash import page_keys

PAGE = 4


def _cached_run(pool: PrefixCachePool, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Allocate and register pages for ``tokens`` (a whole number of pages), as one request would."""
    keys = page_keys(tokens, PAGE)
    pages = pool.allocate(len(keys))
    for p, k in zip(pages, keys):
        assert pool.register(p, k)
    return pages, keys


def test_refcounts_sharing_and_all_pages_back():
    pool = PrefixCachePool(9)
    assert pool.num_free == 8 and pool.num_usable == 8
    a, keys = _cached_run(pool, list(range(12)))  # three full pages
    assert pool.num_free == 5 and all(pool.refcount(p) == 1 for p in a)
    b = pool.acquire(page_keys(list(range(8)) + [99] * 4, PAGE))  # shares the first two pages only
    assert b == a[:2] and [pool.refcount(p) for p in a] == [2, 2, 1]
    pool.free(a)
    assert [pool.refcount(p) for p in a] == [1, 1, 0]
    assert pool.num_free == 6 and pool.num_evictable == 1  # a[2] is cached and can be handed out
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[2:])
    pool.free(b)
    assert pool.num_free == 8 and pool.num_evictable == 3 and pool.num_cached == 3
    again = pool.acquire(keys)  # a later request finds all three
    assert again == a and pool.num_evictable == 0 and pool.num_free == 5
    pool.free(again)
    assert pool.num_free == 8 and all(pool.refcount(p) == 0 for p in range(1, 9))
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0])  # the dummy page is never a request's


def test_keys_are_chained_and_a_gap_ends_the_match():
    pool = PrefixCachePool(9)
    tokens = list(range(12))
    pages, keys = _cached_run(pool, tokens)
    other = page_keys([7] * 4 + tokens[4:], PAGE)  # same tokens in pages 2 and 3, another first page
    assert other[1:] != keys[1:] and pool.match(other) == []
    assert pool.match(keys[:1] + other[1:]) == pages[:1]
    assert pool.match(page_keys(tokens, PAGE, salt=b"another model")) == []
    # A key already cached: the second page holding the same content stays unkeyed and is freed, not cached.
    dup = pool.allocate(1)
    assert not pool.register(dup[0], keys[0])
    pool.free(dup)
    assert pool.num_evictable == 0 and pool.match(keys) == pages
    with pytest.raises(ValueError, match="not in use"):
        pool.register(dup[0], b"k" * 16)


def test_eviction_is_lru_and_only_when_the_free_list_runs_out():
    pool = PrefixCachePool(7)  # six pages
    first, k1 = _cached_run(pool, [1] * 8)  # two pages
    second, k2 = _cached_run(pool, [2] * 8)
    pool.free(first)
    pool.free(second)
    assert pool.num_free == 6 and pool.num_evictable == 4
    assert pool.allocate(2) and pool.num_evictable == 4  # the free list first: nothing evicted
    # Now 4 evictable, 0 free. Least recently freed first; within a chain its last page before the one it extends.
    assert pool.allocate(1) == [first[1]]
    assert pool.match(k1) == first[:1] and pool.match(k2) == second
    pool.acquire(k1[:1])  # used again: most recent, and in use
    assert pool.allocate(2) == [second[1], second[0]]
    with pytest.raises(OutOfPages, match="0 free and 0 evictable"):
        pool.allocate(1)
    assert pool.match(k2) == [] and pool.match(k1) == first[:1]


def test_eviction_under_page_pressure_never_touches_a_page_in_use():
    """Random requests over a few shared prefixes on a pool too small for them all: every page handed
    out has no other owner, cached pages in use are never evicted, and every page comes back."""
    rng = random.Random(0)
    pool = PrefixCachePool(17)
    prefixes = [[rng.randrange(1000) for _ in range(PAGE * rng.randint(1, 4))] for _ in range(5)]
    owners: dict[int, set[int]] = {}  # page -> live requests holding it
    live: dict[int, list[int]] = {}
    evictions = 0
    for step in range(3000):
        if live and (rng.random() < 0.45 or pool.num_free < 6):
            rid = rng.choice(list(live))
            pages = live.pop(rid)
            for p in pages:
                owners[p].discard(rid)
            pool.free(pages)
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(PAGE * rng.randint(0, 2))]
        keys = page_keys(tokens, PAGE)
        hit = pool.acquire(keys)
        cached_before = pool.num_cached
        fresh = pool.allocate(len(keys) - len(hit))
        evictions += cached_before - pool.num_cached
        for p in fresh:
            assert not owners.get(p), f"page {p} handed out while request(s) {owners[p]} hold it"
        for p, k in zip(fresh, keys[len(hit):]):
            pool.register(p, k)
        live[step] = hit + fresh
        for p in hit + fresh:
            owners.setdefault(p, set()).add(step)
            assert pool.refcount(p) == len(owners[p])
    assert evictions > 100 and pool.num_cached > 0
    for pages in live.values():
        pool.free(pages)
    assert pool.num_free == 16 and all(pool.refcount(p) == 0 for p in range(1, 17))
    assert len(pool.allocate(16)) == 16  # every cached page can be evicted once nobody holds it


def test_held_pages_stay_hit_able_but_not_allocatable_until_every_hold_ends():
    pool = PrefixCachePool(9)
    pages, keys = _cached_run(pool, list(range(8)))
    plain = pool.allocate(1)
    pool.hold()
    pool.free(pages + plain)  # freed while a step is in flight: it may still write them
    assert pool.num_free == 5 and pool.num_evictable == 0
    first = pool.take_held()
    assert sorted(first) == sorted(pages + plain)
    assert pool.acquire(keys) == pages  # a later step reading them runs after the one writing them
    pool.free(pages)  # dropped again while the next step is in flight: a second hold
    second = pool.take_held()
    pool.release(first)
    assert pool.num_free == 6 and pool.num_evictable == 0  # ``plain`` is free; ``pages`` are still held
    with pytest.raises(OutOfPages):
        pool.allocate(7)
    pool.release(second)
    assert pool.num_free == 8 and pool.num_evictable == 2 and pool.match(keys) == pages
    # put_back: refs taken and returned with no step sent in between leave no hold behind.
    pool.acquire(keys)
    pool.put_back(pages)
    assert pool.num_free == 8 and pool.take_held() == []
    pool.stop_holding()
    pool.free(pool.allocate(8))
    assert pool.num_free == 8


def test_forget_cached_drops_every_key():
    pool = PrefixCachePool(9)
    pages, keys = _cached_run(pool, list(range(8)))
    held, held_keys = _cached_run(pool, [5] * 4)
    pool.free(pages)
    pool.hold()
    pool.free(held)
    assert pool.forget_cached() == 3
    assert pool.match(keys) == [] and pool.match(held_keys) == [] and pool.num_evictable == 0
    assert pool.num_free == 7  # the held page comes back free, not cached
    pool.stop_holding()
    assert pool.num_free == 8 and pool.num_cached == 0
