"""Page tables held in numpy: one request's (:class:`PageTable`) and one step's rows (:class:`PageRows`).

A decode step of 64 requests of 800 tokens names about 3,200 KV pages. Held as Python lists, every
step turned each of those ints into a C int again (copying the lists into the step message,
flattening them, filling the attention backend's pinned buffer): about 300 µs of the leader's host
time per step. Here a page id crosses from Python into numpy once, when it is allocated; a step
gathers its rows with one ``np.concatenate`` and the attention metadata is built with array
arithmetic.

Invariant (owner: :class:`PageRows`): a step's rows are a copy, never a view of a request's
buffer, so a request that is preempted or finished (and whose pages are reused) while a step
planned from them is still in flight does not change that step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

PAGE_DTYPE = np.int32  # flashinfer's index dtype; the cache checks that its locations fit int32


class PageTable:
    """One request's KV pages in order, in a growable int32 buffer.

    Behaves as a read-only sequence of Python ints (``len``, iteration, indexing, slicing to a list,
    equality with a list); it grows by :meth:`extend` only. :meth:`view` is the live pages as an
    array (valid until the next ``extend``).
    """

    __slots__ = ("_buf", "_n", "_live")
    __hash__ = None  # mutable

    def __init__(self, pages: Iterable[int] = ()) -> None:
        values = _as_pages(pages)
        self._buf = np.empty(max(8, 2 * len(values)), dtype=PAGE_DTYPE)
        self._buf[: len(values)] = values
        self._n = len(values)
        self._live = self._buf[: self._n]  # kept, not re-sliced: a step gathers 64 of these

    def extend(self, pages: Iterable[int]) -> None:
        values = _as_pages(pages)
        end = self._n + len(values)
        if end > len(self._buf):
            grown = np.empty(max(end, 2 * len(self._buf)), dtype=PAGE_DTYPE)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n: end] = values
        self._n = end
        self._live = self._buf[:end]

    def view(self) -> np.ndarray:
        """The pages as an int32 array (a view: copy it to keep it past the next :meth:`extend`)."""
        return self._live

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(self._buf[: self._n].tolist())

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._buf[: self._n][index].tolist()
        return int(self._buf[: self._n][index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PageTable):
            return np.array_equal(self.view(), other.view())
        if isinstance(other, (list, tuple)):
            return self._buf[: self._n].tolist() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"PageTable({self._buf[: self._n].tolist()})"


class PageRows:
    """The page tables of a step's rows in CSR form: row ``i``'s pages are
    ``indices[indptr[i]:indptr[i + 1]]`` (``indices`` int32, ``indptr`` int64 of ``rows + 1``).

    A sequence of rows (each an int32 array); pickles as its two arrays.
    """

    __slots__ = ("indices", "indptr")
    __hash__ = None

    def __init__(self, indices: np.ndarray, indptr: np.ndarray) -> None:
        indices = np.asarray(indices)
        indptr = np.asarray(indptr)
        if indices.ndim != 1 or indptr.ndim != 1 or len(indptr) < 1:
            raise ValueError(f"page rows need 1-D indices and indptr (got shapes {indices.shape}, {indptr.shape})")
        if indptr[0] != 0 or indptr[-1] != len(indices) or (len(indptr) > 1 and np.any(np.diff(indptr) < 0)):
            raise ValueError(f"indptr must rise from 0 to len(indices)={len(indices)}; got {indptr.tolist()}")
        self.indices = indices.astype(PAGE_DTYPE, copy=False)
        self.indptr = indptr.astype(np.int64, copy=False)

    @classmethod
    def gather(cls, tables: Sequence[PageTable | Sequence[int] | np.ndarray]) -> PageRows:
        """A copy of ``tables`` (request page tables, lists or arrays of page ids), one row each."""
        parts = [t._live if type(t) is PageTable else _as_pages(t) for t in tables]
        indptr = np.zeros(len(parts) + 1, dtype=np.int64)
        if not parts:
            return cls._trusted(np.empty(0, dtype=PAGE_DTYPE), indptr)
        np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)), out=indptr[1:])
        return cls._trusted(np.concatenate(parts).astype(PAGE_DTYPE, copy=False), indptr)

    @classmethod
    def _trusted(cls, indices: np.ndarray, indptr: np.ndarray) -> PageRows:
        rows = object.__new__(cls)
        rows.indices, rows.indptr = indices, indptr
        return rows

    def lengths(self) -> np.ndarray:
        """Pages per row (int64)."""
        return np.diff(self.indptr)

    def tolist(self) -> list[list[int]]:
        return [self.indices[a:b].tolist() for a, b in zip(self.indptr[:-1].tolist(), self.indptr[1:].tolist())]

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def __getitem__(self, row: int) -> np.ndarray:
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} of {len(self)}")
        row %= len(self)
        return self.indices[self.indptr[row]: self.indptr[row + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        bounds = self.indptr.tolist()
        return (self.indices[a:b] for a, b in zip(bounds[:-1], bounds[1:]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PageRows):
            return NotImplemented
        return np.array_equal(self.indptr, other.indptr) and np.array_equal(self.indices, other.indices)

    def __reduce__(self):
        return PageRows, (self.indices, self.indptr)

    def __repr__(self) -> str:
        return f"PageRows({self.tolist()})"


def _as_pages(pages: Iterable[int]) -> np.ndarray:
    if isinstance(pages, PageTable):
        return pages.view()
    if isinstance(pages, np.ndarray):
        if pages.ndim != 1 or pages.dtype.kind not in "iu":
            raise ValueError(f"page ids must be a 1-D integer array, got {pages.dtype} of shape {pages.shape}")
        return pages
    values = pages if isinstance(pages, (list, tuple)) else list(pages)
    try:
        return np.asarray(values, dtype=PAGE_DTYPE).reshape(len(values))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"page ids must be ints: {exc}") from exc
