"""The attention-backend seam: ``plan`` on the host, ``run`` on the device.

A backend owns preallocated metadata buffers sized for the largest batch it will ever see.
``plan`` (host side, never inside a CUDA graph) writes one step's metadata into those buffers;
``run`` (device side, graph-safe) reads only those buffers and the paged KV cache, so a graph
captured around ``run`` stays valid when the next step's ``plan`` rewrites the buffers in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from worker.kv_cache import PagedKVCache
from worker.page_table import PageRows


@dataclass(frozen=True)
class AttentionShape:
    """Per-rank attention geometry of a model."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class Rope(NamedTuple):
    """The rotary embedding a layer's ``q`` and ``k`` get before attention (built once a forward).

    ``apply`` is the model's kernel (``Kernels.apply_rope``), used wherever the backend does not
    fuse RoPE into its KV write. A NamedTuple, so ``torch.compile`` traces through it.
    """

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor  # float32 (max_pos, head_dim): cos of the pair frequencies, then sin
    head_dim: int
    apply: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` (tokens, Hq*D) and ``k`` (tokens, Hk*D) rotated by the model's kernel."""
        return self.apply(self.positions, q, k, self.head_dim, self.cos_sin_cache)


@dataclass
class AttentionBatch:
    """Host-side description of one step's attention work, one entry per request row.

    Row ``i`` appends ``query_lens[i]`` new tokens so that the request holds ``seq_lens[i]``
    tokens in the cache afterwards; its pages are ``page_tables[i]`` (covering ``seq_lens[i]``).
    Tokens are laid out request after request in the flat token dimension. ``page_tables`` is a
    :class:`~worker.page_table.PageRows`; any sequence of page lists given is gathered into one.
    ``num_tokens`` may exceed ``sum(query_lens)``: the tail tokens are padding whose KV goes to
    the dummy page and whose attention output is never read.

    The lists are held, not copied: whoever builds a batch must not change them while a step
    planned from it runs. A graph runner's padding rows are not in the lists: the runner asks
    :meth:`AttentionBackend.plan` for the padded row and token counts, and the backend writes
    the padding rows into its buffers.
    """

    is_prefill: bool
    seq_lens: list[int]
    query_lens: list[int]
    page_tables: PageRows
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.page_tables, PageRows):
            self.page_tables = PageRows.gather(self.page_tables)
        n = len(self.seq_lens)
        if len(self.query_lens) != n or len(self.page_tables) != n:
            raise ValueError("seq_lens, query_lens and page_tables must have one entry per row")
        if sum(self.query_lens) > self.num_tokens:
            raise ValueError(f"num_tokens={self.num_tokens} < sum(query_lens)={sum(self.query_lens)}")

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def decode(cls, seq_lens: list[int], page_tables: PageRows | list[list[int]]) -> AttentionBatch:
        return cls(False, list(seq_lens), [1] * len(seq_lens), page_tables, len(seq_lens))

    @classmethod
    def prefill(
        cls, seq_lens: list[int], query_lens: list[int], page_tables: PageRows | list[list[int]]
    ) -> AttentionBatch:
        return cls(True, list(seq_lens), list(query_lens), page_tables, sum(query_lens))

    @classmethod
    def dummy_prefill(cls, tokens: int, page_size: int) -> AttentionBatch:
        """A capture batch: one row of ``tokens`` tokens whose pages are all the dummy page."""
        return cls(True, [tokens], [tokens], [[PagedKVCache.DUMMY_PAGE] * -(-tokens // page_size)], tokens)


def row_geometry(batch: AttentionBatch, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seq_lens, query_lens, pages_needed)`` of ``batch``'s rows as int64 arrays, checked: every
    row has ``0 <= query_len <= seq_len`` and at least the ``ceil(seq_len / page_size)`` pages that
    cover it (a row's pages past those are allowed and unused)."""
    seq = np.array(batch.seq_lens, dtype=np.int64)
    q = np.array(batch.query_lens, dtype=np.int64)
    if (q < 0).any() or (seq < q).any():
        i = int(np.flatnonzero((q < 0) | (seq < q))[0])
        raise ValueError(f"row {i}: query_len={int(q[i])} must be in [0, seq_len={int(seq[i])}]")
    need = (seq + (page_size - 1)) // page_size
    have = batch.page_tables.lengths()
    if (have < need).any():
        i = int(np.flatnonzero(have < need)[0])
        raise ValueError(f"row {i}: seq_len={int(seq[i])} needs {int(need[i])} pages, page table has {int(have[i])}")
    return seq, q, need


def kv_write_locations(batch: AttentionBatch, page_size: int, num_tokens: int | None = None) -> np.ndarray:
    """Flat KV-cache location (``page * page_size + offset``) for every token of ``batch``, padding
    included, as an int64 array.

    Tokens past the rows' query tokens, up to ``num_tokens`` (default ``batch.num_tokens``), write
    to the start of the dummy page; so do decode padding rows (one token at position 0 of the
    dummy page each), which therefore need no rows of their own here.
    """
    seq, q, _ = row_geometry(batch, page_size)
    return locations_of(batch.page_tables, seq, q, page_size, batch.num_tokens if num_tokens is None else num_tokens)


def locations_of(rows: PageRows, seq: np.ndarray, q: np.ndarray, page_size: int, num_tokens: int) -> np.ndarray:
    """:func:`kv_write_locations` of rows already checked by :func:`row_geometry`."""
    one_each = bool(q.size) and bool((q == 1).all())
    live = len(q) if one_each else int(q.sum())
    out = np.empty(max(num_tokens, live), dtype=np.int64)
    out[live:] = PagedKVCache.DUMMY_PAGE * page_size
    if one_each:  # one token a row (decode): at position seq - 1
        pos = seq - 1
        out[:live] = rows.indices[rows.indptr[:-1] + pos // page_size]
    elif live:
        starts = np.zeros(len(q), dtype=np.int64)
        np.cumsum(q[:-1], out=starts[1:])
        # token t of row r sits at position seq[r] - q[r] + (t - starts[r]) of its sequence
        pos = np.arange(live, dtype=np.int64) + np.repeat(seq - q - starts, q)
        out[:live] = rows.indices[np.repeat(rows.indptr[:-1], q) + pos // page_size]
    if live:
        out[:live] *= page_size
        out[:live] += pos % page_size
    return out


class AttentionBackend(ABC):
    """Paged attention for every layer of one model on one rank.

    Contract for ``run``: no allocation outside the caching allocator/graph pool, no host
    synchronisation, no Python-side state that changes between steps; it reads the metadata
    buffers written by the last ``plan`` and the KV cache.
    """

    name: str = "abstract"
    #: The planned tokens' flat KV write locations (entry i: token i's), rewritten by every ``plan``.
    locations: torch.Tensor

    def __init__(self, shape: AttentionShape, kv_cache: PagedKVCache,
                 max_num_rows: int, max_num_tokens: int) -> None:
        self.shape = shape
        self.kv_cache = kv_cache
        self.max_num_rows = max_num_rows
        self.max_num_tokens = max_num_tokens

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def plan(self, batch: AttentionBatch, num_rows: int | None = None, num_tokens: int | None = None) -> None:
        """Write ``batch``'s metadata into this backend's buffers (host side, outside graphs), padded
        to ``num_rows`` rows and, for prefill, ``num_tokens`` tokens (default: the batch's own).

        Padding rows go straight into the buffers, on the reserved dummy page
        (``PagedKVCache.DUMMY_PAGE``): decode padding rows have ``query_len=1, seq_len=1`` and the
        dummy page (one token each, so a padded decode batch has one token per row and takes no
        ``num_tokens``); prefill padding rows are sentinels with ``query_len=0, seq_len=0`` and no
        pages, and tokens past the batch's are tail padding whose KV goes to the dummy page.
        """
        rows = batch.num_rows if num_rows is None else num_rows
        pad = rows - batch.num_rows
        if batch.is_prefill:
            if pad < 0:
                raise ValueError(f"{batch.num_rows} requests do not fit {rows} request slots")
            tokens = batch.num_tokens if num_tokens is None else num_tokens
            if tokens < batch.num_tokens:
                raise ValueError(f"cannot pad {batch.num_tokens} tokens down to {tokens}")
        else:
            if pad < 0:
                raise ValueError(f"cannot pad a batch of {batch.num_rows} rows to {rows}")
            if num_tokens is not None:
                raise ValueError("a decode batch is padded by rows (one token each): leave num_tokens out")
            tokens = batch.num_tokens + pad
        self._plan(batch, rows, tokens)

    @abstractmethod
    def _plan(self, batch: AttentionBatch, num_rows: int, num_tokens: int) -> None:
        """Write ``batch``'s rows and the padding up to ``num_rows`` rows / ``num_tokens`` tokens
        (validated by :meth:`plan`) into this backend's buffers."""

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k, v`` (tokens, kv_heads, head_dim) into the cache and attend.

        ``q`` is (tokens, q_heads, head_dim); returns (tokens, q_heads, head_dim).
        """
        self.store(layer, k, v)
        return self.attend_stored(layer, q)

    def run_with_rope(self, layer: int, rope: Rope, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """:meth:`run` of ``q`` and ``k`` rotated by ``rope``: ``q`` (tokens, Hq*D), ``k`` and ``v``
        (tokens, Hk*D), strided row views allowed; returns (tokens, Hq, D). ``q`` and ``k`` may be
        rotated in place (callers never reuse their old values)."""
        return self.attend_stored(layer, self.store_rotated(layer, rope, q, k, v))

    def store_rotated(self, layer: int, rope: Rope, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """Rotate ``q`` and ``k`` by ``rope``, store ``k, v`` and return the rotated ``q`` as (tokens,
        Hq, D) (inputs as in :meth:`run_with_rope`). Here: the model's RoPE kernel, then
        :meth:`store`; a backend with one kernel for both overrides it (graph-safe either way)."""
        q, k = rope.rotate(q, k)
        tokens, s = q.shape[0], self.shape
        self.store(layer, k.view(tokens, s.num_kv_heads, s.head_dim), v.view(tokens, s.num_kv_heads, s.head_dim))
        return q.view(tokens, s.num_q_heads, s.head_dim)

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of rotated ``q`` (tokens, Hq, D) over the cache, which already holds this step's
        keys and values; returns (tokens, Hq, D)."""
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        self.attend(layer, q, out)
        return out

    @abstractmethod
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's ``k, v`` at the planned locations (graph-safe for every backend)."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of ``q`` over the cache as planned, written into ``out`` (same shape as ``q``)."""

    def graph_safe(self, is_prefill: bool) -> bool:
        """Whether ``run`` for this phase may be recorded inside a CUDA graph."""
        return True
