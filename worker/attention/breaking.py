"""Attention as an eager break: what the ``breakable`` graph backend captures around."""

from __future__ import annotations

import torch

from graphs.breakable import eager_break
from worker.attention.base import AttentionBackend


@eager_break
def _attention_break(backend: AttentionBackend, layer: int, out: torch.Tensor, q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> None:
    # q, k, v and out are boundary buffers: produced/consumed by the neighbouring segments at
    # fixed addresses; the result is written in place.
    out.copy_(backend.run(layer, q, k, v))


class BreakingAttention:
    """Wraps a backend so that every ``run`` is an eager break between graph segments.

    Planning still happens outside the graph before replay; the break re-runs ``run`` eagerly
    on every replay, so attention kernels need not be graph-safe.
    """

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.name = f"{backend.name}+break"

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        _attention_break(self.backend, layer, out, q, k, v)
        return out
