"""Attention as an eager break: what the ``breakable`` graph backend captures around."""

from __future__ import annotations

import torch

from graphs.breakable import eager_break
from worker.attention.base import AttentionBackend, Rope


@eager_break
def _attention_break(backend: AttentionBackend, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
    # q and out are boundary buffers: written/read by the neighbouring segments at fixed
    # addresses; the attention result is written into out in place.
    backend.attend(layer, q, out)


class BreakingAttention:
    """Wraps a backend so that attention is an eager break between graph segments.

    The KV write (graph-safe for every backend) stays in the segment before the break; only the
    attention itself runs eagerly, on every replay, with the metadata planned before the replay,
    so attention kernels need not be graph-safe.
    """

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.name = f"{backend.name}+break"

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.backend.store(layer, k, v)
        return self.attend_stored(layer, q)

    def run_with_rope(self, layer: int, rope: Rope, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attend_stored(layer, self.backend.store_rotated(layer, rope, q, k, v))

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over the stored cache, as the eager break."""
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        _attention_break(self.backend, layer, q, out)
        return out
