"""Paged KV cache storage and the page allocator.

Layout (flashinfer's NHD paged layout, one tensor for all layers)::

    kv[layer, page, 0 (k) | 1 (v), offset_in_page, kv_head, head_dim]

Page 0 is reserved as the dummy page: padded rows of graph replays write their KV there and no
request ever owns it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_page(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem


class PagedKVCache:
    """The KV tensor of every layer; pages are handed out by a :class:`PageAllocator`."""

    DUMMY_PAGE = 0

    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device | str) -> None:
        if shape.num_pages < 2:
            raise ValueError(f"cache.num_pages must be >= 2 (page 0 is the dummy page), got {shape.num_pages}")
        self.shape = shape
        self.page_size = shape.page_size
        self.dtype = dtype
        self.kv = torch.zeros(
            (shape.num_layers, shape.num_pages, 2, shape.page_size, shape.num_kv_heads, shape.head_dim),
            dtype=dtype, device=device,
        )

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def num_pages(self) -> int:
        return self.shape.num_pages

    def layer(self, layer: int) -> torch.Tensor:
        """(pages, 2, page_size, kv_heads, head_dim) view of one layer, contiguous."""
        return self.kv[layer]

    def store(self, layer: int, locations: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v`` (tokens, kv_heads, head_dim) at flat ``locations`` (graph-safe scatter)."""
        cache = self.kv[layer]
        pages = torch.div(locations, self.page_size, rounding_mode="floor")
        offsets = locations - pages * self.page_size
        cache[pages, 0, offsets] = k.to(cache.dtype)
        cache[pages, 1, offsets] = v.to(cache.dtype)


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class HeldPages(ABC):
    """Async scheduling: a page freed while a step is in flight may still be written by that step
    (its request finished, was aborted or preempted after the step was sent), and a KV import into
    it would race that write. Such pages are held back until the step is read back; the allocator
    keeps them in ``_held`` (None: not holding) and says in ``release`` what becomes of them."""

    _held: list[int] | None

    def hold(self) -> None:
        """From now on, freed pages are held back (owned by nobody, not allocatable) until released."""
        if self._held is None:
            self._held = []

    def take_held(self) -> list[int]:
        """The pages held back since the last call; they stay unallocatable (release them)."""
        held = self._held or []
        if self._held is not None:
            self._held = []
        return held

    @abstractmethod
    def release(self, pages: list[int]) -> None:
        """End the hold of pages from :meth:`take_held` (the allocator says what becomes of them)."""

    def stop_holding(self) -> None:
        """Release every held page; freed pages are reusable at once again."""
        self.release(self.take_held())
        self._held = None


class PageAllocator(HeldPages):
    """A free list over pages ``1 .. num_pages-1`` (page 0 is the dummy page): the engine's pages
    with ``cache.prefix_caching`` off (on: :class:`worker.prefix_cache.PrefixCachePool`, the same
    interface plus refcounts and content keys).

    Invariants: a page is either free or owned by exactly one holder; freeing a page that is
    not allocated raises instead of corrupting the free list.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._allocated: set[int] = set()
        self._held: list[int] | None = None  # freed, not yet reusable (see hold)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._allocated:
                raise ValueError(f"page {p} freed but not allocated (double free or foreign page)")
            self._allocated.remove(p)
            (self._free if self._held is None else self._held).append(p)

    def release(self, pages: list[int]) -> None:
        """Make pages from :meth:`take_held` allocatable again."""
        self._free.extend(pages)
