"""Profile-guided bucket ladders under a graph-memory budget.

From a traffic histogram (:class:`graphs.profile.BatchProfile`), measured step costs
(:class:`StepCosts`) and a memory model (:class:`MemoryModel`), pick the subset of candidate
buckets to capture that minimises the histogram's total step time::

    sum over sizes n of hist[n] * cost(n)
    cost(n) = replay(b)  for b the bucket the runner's predicate replays n at (padding included:
                         replay is priced at the padded size b)
              eager(n)   when the predicate says eager (batch too large, too many requests, padding
                         waste), so fallbacks are priced at their measured eager cost

subject to ``memory.ladder_bytes(ladder) <= budget_bytes``. Histogram values may be counts (the
cost is then seconds over the profiled window) or probabilities (seconds per step).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from graphs.buckets import choose_bucket

_TOL = 1e-12


@dataclass(frozen=True)
class PiecewiseLinear:
    """Seconds as a piecewise-linear function of size through measured points.

    Interpolates between measured sizes, extrapolates with the slope of the nearest end segment
    and never returns less than 0 s. One point gives a constant.
    """

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]]) -> PiecewiseLinear:
        """Fit (size, seconds) samples; repeated sizes are averaged."""
        by_size: dict[float, list[float]] = defaultdict(list)
        for size, seconds in samples:
            if not size > 0 or not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"cost sample needs size > 0 and finite seconds >= 0, got ({size}, {seconds})")
            by_size[size].append(seconds)
        if not by_size:
            raise ValueError("a cost model needs at least one (size, seconds) sample")
        xs = sorted(by_size)
        return cls(tuple(xs), tuple(sum(by_size[x]) / len(by_size[x]) for x in xs))

    def __call__(self, size: float) -> float:
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, size), 1), len(xs) - 1)
        return max(0.0, ys[i - 1] + (size - xs[i - 1]) * (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]))


@dataclass(frozen=True)
class StepCosts:
    """One phase's step costs in seconds per forward (wall time of the step on the device).

    ``eager(size)``: an eager forward of ``size`` live rows (decode) or tokens (prefill).
    ``replay(bucket)``: loading and replaying the captured shape ``bucket``, i.e. at padded size.
    Any callables work; :meth:`fit` builds piecewise-linear ones from measurements.
    """

    eager: Callable[[int], float]
    replay: Callable[[int], float]

    @classmethod
    def fit(cls, eager: Iterable[tuple[int, float]], replay: Iterable[tuple[int, float]]) -> StepCosts:
        """From measured (size, seconds) pairs of eager forwards and of replays."""
        return cls(PiecewiseLinear.fit(eager), PiecewiseLinear.fit(replay))


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a ladder of captured shapes keeps resident in the shared graph pool.

    ``shape_bytes(size)`` interpolates linearly between two shapes each captured alone into an
    empty pool (a small one and the largest). Every shape of the process shares one pool and
    capture runs largest first, so the scratch of smaller graphs reuses blocks the largest one
    already reserved; each further graph keeps only its exec and small private allocations,
    ``per_graph_overhead_bytes``. Hence ``ladder_bytes = shape_bytes(max) + overhead * (len - 1)``
    (graphs/DESIGN.md: 35 decode shapes measured at 1.02x the largest alone). Swap the model by
    subclassing and overriding :meth:`ladder_bytes`; the planner is exact for any model that
    depends only on the largest kept bucket and the count, non-decreasing in the count.
    """

    small_size: int
    small_bytes: int
    large_size: int
    large_bytes: int
    per_graph_overhead_bytes: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.small_size <= self.large_size:
            raise ValueError(f"need 1 <= small_size <= large_size, got {self.small_size}, {self.large_size}")
        if min(self.small_bytes, self.large_bytes, self.per_graph_overhead_bytes) < 0:
            raise ValueError("memory measurements must be >= 0 bytes")

    @classmethod
    def from_ladder_capture(cls, resident: Mapping[int, int], small: tuple[int, int]) -> MemoryModel:
        """From one ladder captured largest first into a fresh pool (``{size: CapturedShape.resident_bytes}``:
        the largest's growth is its size alone, the median growth of the others the per-graph
        overhead) and ``small = (size, bytes)`` of a small shape captured alone."""
        largest = max(resident)
        rest = sorted(v for k, v in resident.items() if k != largest)
        overhead = rest[len(rest) // 2] if rest else 0
        return cls(small[0], small[1], largest, resident[largest], max(0, overhead))

    def shape_bytes(self, size: int) -> int:
        """Bytes of one shape captured alone (linear through the two measurements, >= 0)."""
        if self.large_size == self.small_size:
            return self.large_bytes
        slope = (self.large_bytes - self.small_bytes) / (self.large_size - self.small_size)
        return max(0, math.ceil(self.small_bytes + slope * (size - self.small_size)))

    def ladder_bytes(self, ladder: Sequence[int]) -> int:
        """Modelled resident bytes of ``ladder`` captured into one pool (0 for an empty ladder)."""
        if not ladder:
            return 0
        return self.shape_bytes(max(ladder)) + self.per_graph_overhead_bytes * (len(ladder) - 1)


@dataclass(frozen=True)
class Plan:
    """A chosen ladder, its cost under the objective, modelled resident bytes, what was left out."""

    ladder: list[int]
    expected_cost_s: float
    resident_bytes: int
    dropped: list[int]
    notes: list[str]


@dataclass(frozen=True)
class DecodeProblem:
    """Inputs of :func:`plan_decode_ladder` (and the decode half of :func:`plan_ladders`)."""

    hist: Mapping[int, float]
    candidates: Sequence[int]
    costs: StepCosts
    memory: MemoryModel
    max_batch_size: int


@dataclass(frozen=True)
class PrefillProblem:
    """Inputs of :func:`plan_prefill_ladder` (and the prefill half of :func:`plan_ladders`)."""

    hist: Mapping[tuple[int, int], float]
    candidates: Sequence[int]
    costs: StepCosts
    memory: MemoryModel
    ceiling: int
    slots: int
    max_padding_ratio: float


@dataclass(frozen=True)
class JointPlan:
    """Both phases' plans; ``resident_bytes`` is the joint model (:func:`joint_bytes`)."""

    decode: Plan
    prefill: Plan
    expected_cost_s: float
    resident_bytes: int


# ----- the runner's predicate, for evaluation -----

def decode_bucket(n: int, ladder: Sequence[int]) -> int | None:
    """The bucket the decode runner (padding on) replays ``n`` rows at, or None (eager)."""
    return choose_bucket(n, ladder, padding=True).size if ladder else None


def prefill_bucket(tokens: int, requests: int, ladder: Sequence[int], slots: int,
                   max_padding_ratio: float) -> int | None:
    """The bucket ``PrefillGraphRunner._choose`` replays at, or None (too many requests, too large,
    padding waste)."""
    if requests > slots or not ladder:
        return None
    b = choose_bucket(tokens, ladder, padding=True).size
    return None if b is None or b > max_padding_ratio * tokens else b


def decode_cost(hist: Mapping[int, float], ladder: Sequence[int], costs: StepCosts) -> float:
    """The objective for a decode ladder: sum of hist[n] * (replay(bucket) or eager(n))."""
    total = 0.0
    for n, w in hist.items():
        b = decode_bucket(n, ladder)
        total += w * (costs.eager(n) if b is None else costs.replay(b))
    return total


def prefill_cost(hist: Mapping[tuple[int, int], float], ladder: Sequence[int], costs: StepCosts,
                 slots: int, max_padding_ratio: float) -> float:
    """The objective for a prefill ladder under the runner's slot and padding-waste rules."""
    total = 0.0
    for (t, r), w in hist.items():
        b = prefill_bucket(t, r, ladder, slots, max_padding_ratio)
        total += w * (costs.eager(t) if b is None else costs.replay(b))
    return total


def expected_padded_rows(hist: Mapping[int, float], ladder: Sequence[int]) -> float:
    """Padding rows replayed, weighted by ``hist`` (eager batches pad nothing)."""
    return sum(w * (b - n) for n, w in hist.items() if (b := decode_bucket(n, ladder)) is not None)


def expected_padded_tokens(hist: Mapping[tuple[int, int], float], ladder: Sequence[int],
                           slots: int | None = None, max_padding_ratio: float = math.inf) -> float:
    """Padding tokens replayed, weighted by ``hist``; ``slots=None`` means no slot limit."""
    limit = math.inf if slots is None else slots
    return sum(w * (b - t) for (t, r), w in hist.items()
               if (b := prefill_bucket(t, r, ladder, limit, max_padding_ratio)) is not None)
