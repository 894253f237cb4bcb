"""Copy a request's KV pages out of one rank's cache and into another's (the KV hand-off's ends).

A payload is the pages' slice of the cache tensor in page order::

    payload[layer, i, 0 (k) | 1 (v), offset_in_page, kv_head_local, head_dim]   (i-th page given)

``kv_head_local`` is this rank's share of the KV heads, so a tensor-parallel group hands over one
payload per rank and rank ``r`` of the receiving group must hold the same heads as rank ``r`` of
the sender (equal tp sizes; see :func:`kv_layout`). Page 0 is the dummy page and never moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.kv_cache import PagedKVCache
from worker.worker import Worker


class KVPagesError(ValueError):
    """A page list or payload that does not fit this rank's KV cache; the message names the mismatch."""


@dataclass(frozen=True)
class KVLayout:
    """What must match between two ranks for a payload from one to import into the other."""

    num_layers: int
    page_size: int
    num_kv_heads: int  # on this rank
    head_dim: int
    dtype: str
    tp_rank: int
    tp_size: int

    def payload_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, num_pages, 2, self.page_size, self.num_kv_heads, self.head_dim)

    def mismatch(self, other: KVLayout) -> str | None:
        """Why a payload laid out as ``self`` cannot import into ``other`` (None if it can)."""
        if self.tp_size != other.tp_size:
            return (f"tp_size {self.tp_size} -> {other.tp_size}: KV hand-off needs equal tp sizes "
                    "(resharding by kv-head slices is not implemented)")
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim", "dtype"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{name} {a} -> {b}"
        return None


def _cache(worker: Worker) -> PagedKVCache:
    if worker.kv_cache is None:
        raise KVPagesError("this rank has no KV cache yet (allocate() has not run)")
    return worker.kv_cache


def kv_layout(worker: Worker) -> KVLayout:
    """This rank's KV layout (after ``allocate``)."""
    shape = _cache(worker).shape
    return KVLayout(shape.num_layers, shape.page_size, shape.num_kv_heads, shape.head_dim,
                    str(worker.dtype).removeprefix("torch."), worker.tp.rank, worker.tp.size)


def _page_index(cache: PagedKVCache, pages: Sequence[int]) -> torch.Tensor:
    pages = [int(p) for p in pages]
    if not pages:
        raise KVPagesError("no pages given")
    bad = [p for p in pages if not 1 <= p < cache.num_pages]
    if bad:
        raise KVPagesError(f"page {bad[0]} outside [1, {cache.num_pages}) (page 0 is the dummy page)")
    if len(set(pages)) != len(pages):
        raise KVPagesError(f"pages repeat: {pages}")
    return torch.tensor(pages, dtype=torch.int64, device=cache.device)


def export_pages(worker: Worker, pages: Sequence[int], to_host: bool = False) -> torch.Tensor:
    """A copy of ``pages``' KV on this rank, ``(layers, len(pages), 2, page_size, kv_heads, head_dim)``.

    The copy is taken now, so the pages may be reused by any later step on this rank.
    ``to_host`` returns it in CPU memory (what the object-store transport ships).
    """
    cache = _cache(worker)
    out = cache.kv.index_select(1, _page_index(cache, pages))
    return out.cpu() if to_host else out


def import_pages(worker: Worker, pages: Sequence[int], payload: torch.Tensor) -> None:
    """Write ``payload`` (from :func:`export_pages` on the matching rank) into ``pages`` of this rank."""
    cache = _cache(worker)
    index = _page_index(cache, pages)
    want = kv_layout(worker).payload_shape(len(index))
    if tuple(payload.shape) != want:
        raise KVPagesError(f"payload shape {tuple(payload.shape)} does not fit {len(index)} pages of this rank's "
                           f"KV cache {want} (layers, pages, k|v, page_size, kv_heads, head_dim)")
    if payload.dtype != cache.dtype:
        raise KVPagesError(f"payload dtype {payload.dtype} differs from this rank's KV cache dtype {cache.dtype}")
    cache.kv.index_copy_(1, index, payload.to(cache.device, non_blocking=True))
