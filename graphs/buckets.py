"""Shape ladders and the choice of a captured shape for a live batch."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


def default_decode_ladder(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch_size`` (always included)."""
    ladder = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    ladder += list(range(16, max_batch_size + 1, 8))
    if ladder[-1] != max_batch_size:
        ladder.append(max_batch_size)
    return ladder


def validate_ladder(ladder: Sequence[int], what: str) -> list[int]:
    ladder = list(ladder)
    if not ladder or ladder[0] < 1 or any(a >= b for a, b in zip(ladder, ladder[1:])):
        raise ValueError(f"{what} must be non-empty, positive and strictly increasing, got {ladder}")
    return ladder


@dataclass(frozen=True)
class BucketChoice:
    """The captured size a live batch replays at, or ``None`` with the reason it runs eagerly."""

    size: int | None
    reason: str | None = None

    @property
    def replays(self) -> bool:
        return self.size is not None


def choose_bucket(n: int, ladder: Sequence[int], padding: bool) -> BucketChoice:
    """Smallest captured size >= ``n`` (padding on), or exactly ``n`` (padding off)."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    if n > ladder[-1]:
        return BucketChoice(None, "batch_too_large")
    i = bisect.bisect_left(ladder, n)
    if ladder[i] == n:
        return BucketChoice(n)
    if not padding:
        return BucketChoice(None, "padding_disabled")
    return BucketChoice(ladder[i])
