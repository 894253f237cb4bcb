"""The decode runner: batch-size buckets over a model-agnostic decode step.

The runner knows only a :class:`DecodeStep` (plan attention for a padded batch; run the
graph-safe forward from token ids and positions to logits). Static buffers are allocated once
at the largest bucket; a live batch of ``n`` rows is copied into rows ``[0, n)``, rows
``[n, bucket)`` are reset to token 0 / position 0 on every replay, and the step plans them as
padding rows that write their KV to the reserved dummy page. Only rows ``[0, n)`` of the one
max-size logits buffer are returned, so padding is never sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphs.backends import GraphBackend
from graphs.metrics import GraphMetrics
from graphs.runner import GraphRunner
from graphs.tokens import StaticTokens


class DecodeStep(Protocol):
    """What a model offers the decode runner (implemented on the worker side)."""

    vocab_size: int
    device: torch.device

    def plan(self, attention: Any, padded_rows: int) -> None:
        """Host side: plan attention for the live rows in ``attention`` plus padding rows."""

    def plan_dummy(self, rows: int) -> None:
        """Host side: plan ``rows`` padding rows (for warm-up and capture)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device side, graph-safe: (rows,) ids and positions -> (rows, vocab) logits, float32 or a
        narrower float type that the runner's float32 output holds exactly (its copy is the cast)."""


@dataclass
class LiveDecodeBatch:
    """One decode step: ``input_ids``/``positions`` of the live rows and the step's attention batch."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: Any

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class DecodeBuffers:
    """Static inputs and the one max-size output of the decode runner (fixed addresses)."""

    tokens: StaticTokens  # (max_bs,) ids and positions
    logits: torch.Tensor  # (max_bs, vocab) float32

    @classmethod
    def allocate(cls, max_rows: int, vocab: int, device: torch.device) -> DecodeBuffers:
        return cls(StaticTokens.allocate(max_rows, device),
                   torch.zeros((max_rows, vocab), dtype=torch.float32, device=device))


class DecodeGraphRunner(GraphRunner[LiveDecodeBatch, torch.Tensor]):
    """Pads live decode batches to captured batch sizes and replays them."""

    phase = "decode"

    def __init__(self, step: DecodeStep, backend: GraphBackend, ladder: list[int], padding: bool = True,
                 metrics: GraphMetrics | None = None) -> None:
        super().__init__(backend, ladder, padding, metrics)
        self.step = step
        self.buffers = DecodeBuffers.allocate(self.ladder[-1], step.vocab_size, step.device)

    def batch_size(self, batch: LiveDecodeBatch) -> int:
        return batch.size

    def capture_callable(self, size: int) -> Callable[[], None]:
        ids, pos = self.buffers.tokens.views(size)
        out = self.buffers.logits[:size]
        self.step.plan_dummy(size)

        def forward() -> None:
            out.copy_(self.step.forward(ids, pos))

        return forward

    def load(self, batch: LiveDecodeBatch, size: int) -> None:
        self.buffers.tokens.load(batch.input_ids, batch.positions, size)
        self.step.plan(batch.attention, size)

    def outputs(self, batch: LiveDecodeBatch) -> torch.Tensor:
        return self.buffers.logits[: batch.size]
