"""Tensor-parallel identity of one rank and the two collectives the layers use.

With ``size == 1`` no collective is ever called, so single-GPU and CPU paths take no
``torch.distributed`` dependency. Collectives are issued on the current stream, which is the
capture stream while a CUDA graph is being captured: that is what records them in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CollectiveCounts:
    """Collective calls this rank issued: while a CUDA graph was being captured (recorded into
    it, never called again on replay) and eagerly. Host-side counters only."""

    captured: int = 0
    eager: int = 0

    def count(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.captured += 1
        else:
            self.eager += 1


@dataclass(frozen=True)
class TensorParallel:
    """``rank`` of ``size`` in the tensor-parallel group ``group`` (None: the default group).

    ``collectives_at_tp1`` (``cluster.collectives_at_tp1``) issues the all-reduce even for a group of one: it changes no
    value, and lets a single GPU verify that collectives are recorded inside graphs.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    collectives_at_tp1: bool = False
    counts: CollectiveCounts = field(default_factory=CollectiveCounts, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside [0, {self.size})")

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``total`` items."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tp_size={self.size}")
        n = total // self.size
        return self.rank * n, n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1 or self.collectives_at_tp1:
            self.counts.count()
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        self.counts.count()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
