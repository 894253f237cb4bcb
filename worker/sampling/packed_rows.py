"""A step's sampled rows as one int32 matrix: its tokens and log-probabilities in one read-back copy.

Row i holds, for ``W`` alternatives (0 when no row asked for any): column 0 the token id, column 1
the float32 bits of its log-probability, columns ``2 .. 2+W`` the alternatives' ids and columns
``2+W .. 2+2W`` the float32 bits of their log-probabilities. Ids fit in int32 (a vocabulary is
smaller than 2**31), and the host reads the bits back as float32, so :func:`unpack_lists` gives
exactly the lists that ``.tolist()`` of the separate tensors gives.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.sampling.params import MAX_TOP_LOGPROBS

__all__ = ["PACKED_COLUMNS", "pack", "unpack_lists"]

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
                 ) -> tuple[list[int], list[float], tuple[list[list[int]], list[list[float]]] | None]:
    """(token ids, log-probabilities, ``(ids rows, log-probability rows)`` or None when W is 0) of
    host rows laid out by :func:`pack`."""
    width = (packed.shape[1] - 2) // 2
    tops = None
    if width:
        tops = (packed[:, 2:2 + width].tolist(), packed[:, 2 + width:].view(np.float32).tolist())
    return packed[:, 0].tolist(), packed[:, 1].view(np.float32).tolist(), tops
