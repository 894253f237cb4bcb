"""Which group most likely holds a prompt's prefix in its KV cache: the router's model of the caches.

The fleet does not ask its groups what they cache (a round trip per request); it remembers what it
sent where, as SGLang's cache-aware router and Ray Serve LLM's prefix-aware router do. Per group it
keeps the page keys (:func:`worker.prefix_hash.page_keys`, the engine's own keys) of the prompts it
placed there, least recently used first, at most as many as the group has usable KV pages (the
group cannot hold more; its own LRU evicts the oldest first too). A request's match on a group is
the number of its leading page keys the group's table holds.

The table is a guess, never a promise: the engine looks its prefix up itself and computes whatever
is not cached. It can be wrong both ways (a group evicts under pressure from decode pages; another
request's prompt may have cached the same prefix), which costs time, never correctness. A group
that restarts has lost its cache: :meth:`PrefixAffinity.forget` empties its table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from worker.prefix_hash import PageKey


class PrefixAffinity:
    """Per group, an LRU set of the page keys placed there (owned by the fleet's loop thread)."""

    def __init__(self) -> None:
        self._tables: dict[str, OrderedDict[PageKey, None]] = {}

    def match(self, group_id: str, keys: Sequence[PageKey]) -> int:
        """How many of ``keys`` (a prompt's page keys, in order) lead ``group_id``'s table."""
        table = self._tables.get(group_id)
        if not table:
            return 0
        n = 0
        for key in keys:
            if key not in table:
                break
            n += 1
        return n

    def record(self, group_id: str, keys: Sequence[PageKey], capacity: int) -> None:
        """``keys`` were placed on ``group_id`` (now its most recently used); the table keeps at most
        ``capacity`` keys (the group's usable KV pages), dropping the least recently used."""
        table = self._tables.setdefault(group_id, OrderedDict())
        for key in keys:
            table[key] = None
            table.move_to_end(key)
        while len(table) > max(0, capacity):
            table.popitem(last=False)

    def forget(self, group_id: str) -> None:
        """``group_id`` lost its KV cache (it died or restarted)."""
        self._tables.pop(group_id, None)

    def size(self, group_id: str) -> int:
        """Keys held for ``group_id``."""
        return len(self._tables.get(group_id, ()))
