"""A step's sampled rows as one int32 matrix: its tokens and log-probabilities in one read-back copy.

Row i holds, for ``W`` alternatives (0 when no row asked for any): column 0 the token id, column 1
the float32 bits of its log-probability, columns ``2 .. 2+W`` the alternatives' ids and columns
``2+W .. 2+2W`` the float32 bits of their log-probabilities. Ids fit in int32 (a vocabulary is
smaller than 2**31), and the host reads the bits back as float32.

:func:`unpack_lists` gives the tokens and their log-probabilities as lists, and each row's
alternatives as two ``bytes`` (its W int32 ids, its W float32 log-probabilities, in this machine's
byte order): building 2 x 64 x 20 Python numbers per step cost the engine's step ~50 us on a
host-bound step (issue 19), slicing one ``bytes`` per row about a fifth of that, and ``bytes``
pickle as builtins on the way to the API. Entries keep them so until the API spells them out:
:func:`alternatives` decodes them into exactly the lists ``.tolist()`` of the tensors gives.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.sampling.params import MAX_TOP_LOGPROBS

__all__ = ["PACKED_COLUMNS", "alternatives", "first_alternatives", "pack", "row_bytes", "row_width",
           "spelled_entries", "unpack_lists"]

#: Columns of the widest packed row (``MAX_TOP_LOGPROBS`` alternatives).
PACKED_COLUMNS = 2 + 2 * MAX_TOP_LOGPROBS


def pack(tokens: torch.Tensor, chosen: torch.Tensor, ids: torch.Tensor | None, values: torch.Tensor | None,
         ) -> torch.Tensor:
    """(B, 2 + 2W) int32 rows of ``tokens`` (B,), their float32 log-probabilities ``chosen`` (B,)
    and, unless None, the alternatives' ``ids`` (B, W) and float32 log-probabilities ``values``."""
    columns = [tokens.to(torch.int32)[:, None], chosen.view(torch.int32)[:, None]]
    if ids is not None:
        columns += [ids.to(torch.int32), values.view(torch.int32)]
    return torch.cat(columns, dim=1)


def unpack_lists(packed: np.ndarray,
                 ) -> tuple[list[int], list[float], tuple[list[bytes], list[bytes]] | None]:
    """(token ids, log-probabilities, ``(ids rows, log-probability rows)`` as :func:`row_bytes`, or
    None when W is 0) of host rows laid out by :func:`pack`."""
    width = (packed.shape[1] - 2) // 2
    tops = None
    if width:
        tops = (row_bytes(packed[:, 2:2 + width]), row_bytes(packed[:, 2 + width:].view(np.float32)))
    return packed[:, 0].tolist(), packed[:, 1].view(np.float32).tolist(), tops


def row_bytes(block: np.ndarray) -> list[bytes]:
    """Each row of a (B, W) int32 or float32 array (any strides) as one ``bytes`` (one copy of the
    block in row order, then a slice per row)."""
    data = block.tobytes()
    step = block.shape[1] * 4
    return [data[i:i + step] for i in range(0, len(data), step)]


def row_width(rows: list[bytes]) -> int:
    """How many alternatives each of a step's :func:`row_bytes` rows holds (0 for no rows)."""
    return len(rows[0]) // 4 if rows else 0


def first_alternatives(ids: bytes, values: bytes, k: int) -> tuple[bytes, bytes]:
    """The first ``k`` of an entry's alternatives (:func:`row_bytes` rows)."""
    return ids[:4 * k], values[:4 * k]


def alternatives(ids: bytes | list, values: bytes | list) -> tuple[list[int], list[float]]:
    """An entry's alternatives as lists: ``bytes`` rows (:func:`unpack_lists`) decoded, lists (the
    prompt's entries) as they are."""
    if isinstance(ids, bytes):
        return np.frombuffer(ids, np.int32).tolist(), np.frombuffer(values, np.float32).tolist()
    return ids, values


def spelled_entries(entries: list | None) -> list | None:
    """A request's log-probability entries with every entry's alternatives as lists (a bare
    log-probability, or ``(logprob, ids, logprobs)``): what a finished request's output holds."""
    if entries is None:
        return None
    return [e if not isinstance(e, tuple) else (e[0], *alternatives(e[1], e[2])) for e in entries]
