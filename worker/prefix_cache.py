"""Automatic prefix caching: a page pool whose full pages outlive their requests, keyed by content.

A full page whose KV has been scheduled to be written is *registered* under its key
(:func:`worker.prefix_hash.page_keys`: a hash chained over every token up to the page's end), and a
request whose sequence starts with the same full pages takes them instead of computing them again.
States of a page (page 0, the dummy page, is never in the pool)::

    free --allocate--> in use (refs > 0) --last ref dropped--> evictable (keyed)  or  free (no key)
                         ^      |                                   |
                         +------+---- acquire (a prefix hit) <------+
                                |
                                +--last ref dropped while holding--> held --release--> evictable / free

Invariants (owner: :class:`PrefixCachePool`):

- **Refcounts**: a page's refcount is the number of requests whose page table holds it; the
  scheduler takes one ref per request (``allocate`` or ``acquire``) and drops it once (``free``)
  on finish, abort, hand-off or preemption. A page is shared only while it is keyed and full, so
  no request ever writes into a page another request holds: new tokens go past the cached prefix.
- **Registration**: a key maps to at most one page, and a page has at most one key, set once the
  page is full of tokens whose KV a sent step writes (:meth:`PrefixCachePool.register`; a second
  page with a key already taken stays unkeyed and is freed like any other).
- **Eviction** touches only evictable pages (keyed, refcount 0, not held), least recently used
  first, and only when an allocation needs more pages than the free list has (a request's pages
  are freed last first, so a chain's tail goes before the pages it extends). ``num_free`` counts
  free and evictable pages: both can be handed out now.
- **Hold** (async scheduling, see :class:`worker.kv_cache.PageAllocator`): a page whose last ref
  is dropped while a step is in flight may still be written by that step (the step that filled a
  keyed page is the one sent just before it was registered), so it is neither free nor evictable
  until every held batch holding it is released; a keyed held page may still be *acquired* (a
  later step that reads it runs after the one that writes it). ``allocate`` never hands out a
  held page, so a KV import cannot race the step's late write.
- **Failure**: :meth:`PrefixCachePool.forget_cached` drops every key (a lost step may not have
  written the pages it registered); evictable pages become free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from worker.kv_cache import HeldPages, OutOfPages
from worker.prefix_hash import PageKey


class PrefixCachePool(HeldPages):
    """Pages ``1 .. num_pages-1`` with refcounts, content keys and LRU eviction.

    The interface of :class:`worker.kv_cache.PageAllocator` (``allocate``, ``free``, the hold
    protocol), plus :meth:`acquire` / :meth:`match` for prefix hits and :meth:`register`.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages
        self._holds = [0] * num_pages  # held batches holding the page, not yet released
        self._key_of: list[PageKey | None] = [None] * num_pages
        self._page_of: dict[PageKey, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._held: list[int] | None = None

    # ----- what the scheduler sees -----

    @property
    def num_free(self) -> int:
        """Pages an allocation can have now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_cached(self) -> int:
        """Pages with a key (in use, held or evictable)."""
        return len(self._page_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages (refcount 1, no key): free ones first, then the least recently used evictable."""
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free and {len(self._evictable)} evictable")
        pages = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:
            page, _ = self._evictable.popitem(last=False)
            self._unkey(page)
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one ref on each page (a request's page table, in order); a page left with none becomes
        evictable if keyed, else free (held instead, while holding)."""
        for p in reversed(list(pages)):  # a chain's last page is evicted before the pages it extends
            p = int(p)
            if not 1 <= p < self.num_pages or self._refs[p] == 0:
                raise ValueError(f"page {p} freed but not allocated (double free or foreign page)")
            self._refs[p] -= 1
            if self._refs[p]:
                continue
            if self._held is not None:
                self._holds[p] += 1
                self._held.append(p)
            else:
                self._park(p)

    # ----- prefix hits and registration -----

    def match(self, keys: Sequence[PageKey]) -> list[int]:
        """The pages of the longest run of ``keys`` (from the first) that are cached; takes no refs."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, keys: Sequence[PageKey]) -> list[int]:
        """:meth:`match`, taking one ref on each page found (an evictable page is in use again)."""
        pages = self.match(keys)
        for p in pages:
            if self._refs[p] == 0:
                self._evictable.pop(p, None)
            self._refs[p] += 1
        return pages

    def put_back(self, pages: Sequence[int]) -> None:
        """Return refs :meth:`acquire` took with no step sent since (the request stays waiting): no step
        can have written the pages in between, so none is held for it."""
        for p in reversed(list(pages)):
            if self._refs[p] == 0:
                raise ValueError(f"page {p} put back but not acquired")
            self._refs[p] -= 1
            if self._refs[p] == 0 and self._holds[p] == 0:
                self._park(p)

    def register(self, page: int, key: PageKey) -> bool:
        """Key ``page`` (in use, full, its KV written by a sent step); False if the key or the page
        already has one (the page then stays as it is)."""
        if self._refs[page] == 0:
            raise ValueError(f"page {page} registered but not in use")
        if key in self._page_of or self._key_of[page] is not None:
            return False
        self._key_of[page] = key
        self._page_of[key] = page
        return True

    def forget_cached(self) -> int:
        """Drop every key (evictable pages become free); returns how many pages had one."""
        keyed = len(self._page_of)
        for page in list(self._page_of.values()):
            self._key_of[page] = None
        self._page_of.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        return keyed

    # ----- async scheduling: pages freed while a step is in flight -----

    def release(self, pages: Sequence[int]) -> None:
        """End the hold of pages from :meth:`take_held`: each one no longer held and without refs
        becomes evictable (keyed) or free."""
        for p in pages:
            self._holds[p] -= 1
            if self._holds[p] == 0 and self._refs[p] == 0:
                self._park(p)

    # ----- internals -----

    def _park(self, page: int) -> None:
        """A page with no refs and no holds: evictable (most recently used) if keyed, else free."""
        if self._key_of[page] is not None:
            self._evictable[page] = None
        else:
            self._free.append(page)

    def _unkey(self, page: int) -> None:
        key = self._key_of[page]
        if key is not None:
            del self._page_of[key]
            self._key_of[page] = None
