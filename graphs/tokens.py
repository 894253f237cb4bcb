"""The static token inputs every runner replays from: ids and positions at fixed addresses."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StaticTokens:
    """``input_ids`` and ``positions`` (int64) allocated once at a runner's largest shape."""

    input_ids: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def allocate(cls, max_tokens: int, device: torch.device) -> StaticTokens:
        return cls(torch.zeros(max_tokens, dtype=torch.int64, device=device),
                   torch.zeros(max_tokens, dtype=torch.int64, device=device))

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, size: int) -> None:
        """Copy the live tokens into ``[0, n)`` and reset the padding region ``[n, size)`` to 0."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()

    def views(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``size`` ids and positions, zeroed (a capture's dummy batch)."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        return self.input_ids[:size], self.positions[:size]
