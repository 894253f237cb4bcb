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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from graphs.buckets import choose_bucket
from graphs.profile import MemoryModel, PiecewiseLinear, StepCosts

__all__ = [
    "DecodeProblem", "JointPlan", "MemoryModel", "PiecewiseLinear", "Plan", "PrefillProblem", "StepCosts",
    "decode_bucket", "expected_padded_rows", "expected_padded_tokens", "joint_bytes", "padding_share",
    "replayed_padding",
    "plan_decode_ladder", "plan_ladders", "plan_prefill_ladder", "prefill_bucket",
]

_TOL = 1e-12


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


def expected_padded_rows(hist: Mapping[int, float], ladder: Sequence[int]) -> float:
    """Padding rows replayed, weighted by ``hist`` (eager batches pad nothing)."""
    return sum(w * (b - n) for n, w in hist.items() if (b := decode_bucket(n, ladder)) is not None)


def expected_padded_tokens(hist: Mapping[tuple[int, int], float], ladder: Sequence[int],
                           slots: int | None = None, max_padding_ratio: float = math.inf) -> float:
    """Padding tokens replayed, weighted by ``hist``; ``slots=None`` means no slot limit."""
    limit = math.inf if slots is None else slots
    return sum(w * (b - t) for (t, r), w in hist.items()
               if (b := prefill_bucket(t, r, ladder, limit, max_padding_ratio)) is not None)


def replayed_padding(profile, decode_ladder: Sequence[int] | None, prefill_ladder: Sequence[int] | None,
                     slots: int = 1, max_padding_ratio: float = math.inf) -> dict[str, tuple[float, float, int]]:
    """Per phase with a ladder (None: no graphs) and steps in ``profile``: ``(padded, live, steps)``,
    the rows (decode) or tokens (prefill) that padding added to its graph-replayed steps, the live
    ones those steps carried (eager steps count in neither), and its steps.

    ``profile`` is a :class:`graphs.profile.BatchProfile`.
    """
    out = {}
    if decode_ladder is not None and profile.decode_steps:
        hist = profile.decode
        live = sum(n * w for n, w in hist.items() if decode_bucket(n, decode_ladder) is not None)
        out["decode"] = (expected_padded_rows(hist, decode_ladder), live, profile.decode_steps)
    if prefill_ladder is not None and profile.prefill_steps:
        hist = profile.prefill
        live = sum(t * w for (t, r), w in hist.items()
                   if prefill_bucket(t, r, prefill_ladder, slots, max_padding_ratio) is not None)
        out["prefill"] = (expected_padded_tokens(hist, prefill_ladder, slots, max_padding_ratio), live,
                          profile.prefill_steps)
    return out


def padding_share(profile, decode_ladder: Sequence[int] | None, prefill_ladder: Sequence[int] | None,
                  slots: int = 1, max_padding_ratio: float = math.inf) -> dict[str, tuple[float, int]]:
    """Per phase of :func:`replayed_padding`: ``(share, steps)``, the share of what its graphs
    replayed that was padding."""
    return {phase: (padded / (padded + live) if padded + live else 0.0, steps)
            for phase, (padded, live, steps) in
            replayed_padding(profile, decode_ladder, prefill_ladder, slots, max_padding_ratio).items()}


# ----- the optimiser -----

class _Table:
    """Exact DP over "last kept bucket" for one phase.

    ``cands`` c_0 < ... < c_{m-1}; a kept bucket c_j serves the sizes in (previous kept, c_j].
    ``f[k][j]`` is the least cost of the sizes <= c_j with exactly k kept buckets, the largest c_j:
    ``f[1][j] = seg(-1, j)``, ``f[k][j] = min_{i<j} f[k-1][i] + seg(i, j)``; sizes above c_j run
    eagerly (``tail[j]``). O(m * |sizes|) to tabulate ``seg``, O(K * m^2) for the DP.
    """

    def __init__(self, cands: list[int], sizes: dict[int, float], eager: Callable[[int], float],
                 served: Callable[[int, int], float], fixed: float, kmax: int) -> None:
        m = self.m = len(cands)
        self.cands, self.fixed = cands, fixed
        by_q: list[list[tuple[int, float]]] = [[] for _ in range(m + 1)]
        for s, w in sizes.items():
            by_q[bisect.bisect_left(cands, s)].append((s, w))
        eager_q = [sum(w * eager(s) for s, w in group) for group in by_q]
        self.tail = [sum(eager_q[j + 1:]) for j in range(m)] + [sum(eager_q)]  # tail[-1]: no bucket
        seg = []  # seg[j][q] = cost of the sizes in (c_{q-1}, c_j] replayed at or falling back from c_j
        for j in range(m):
            row, acc = [0.0] * (j + 1), 0.0
            for q in range(j, -1, -1):
                acc += sum(w * served(j, s) for s, w in by_q[q])
                row[q] = acc
            seg.append(row)
        self.f = [[math.inf] * m for _ in range(kmax + 1)]
        self.arg = [[-1] * m for _ in range(kmax + 1)]
        if kmax:
            self.f[1] = [seg[j][0] for j in range(m)]
        for k in range(2, kmax + 1):
            prev, cur, arg = self.f[k - 1], self.f[k], self.arg[k]
            for j in range(k - 1, m):
                row = seg[j]
                cur[j], arg[j] = min((prev[i] + row[i + 1], i) for i in range(k - 2, j))

    def cost(self, j: int, k: int) -> float:
        return self.fixed + (self.tail[-1] if k == 0 else self.f[k][j] + self.tail[j])

    def ladder(self, j: int, k: int) -> list[int]:
        out = []
        while k >= 1:
            out.append(self.cands[j])
            j, k = self.arg[k][j], k - 1
        return out[::-1]


def _kcap(cands: list[int], memory: MemoryModel, budget: int) -> list[int]:
    """Per largest index j, the most buckets that fit (ladder_bytes non-decreasing in the count)."""
    caps = []
    for j in range(len(cands)):
        k = 0
        while k <= j and memory.ladder_bytes(cands[:k] + [cands[j]]) <= budget:
            k += 1
        caps.append(k)
    return caps


def _check(budget_bytes: int, hist: Mapping, what: str) -> None:
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    bad = [k for k, w in hist.items() if not (math.isfinite(w) and w >= 0)]
    if bad:
        raise ValueError(f"{what} histogram weight of {bad[0]} must be finite and >= 0")


def _decode_table(p: DecodeProblem, budget: int, notes: list[str]) -> tuple[_Table, list[int]]:
    _check(budget, p.hist, "decode")
    cands = sorted({c for c in p.candidates if 1 <= c <= p.max_batch_size})
    if above := sorted(c for c in set(p.candidates) if c > p.max_batch_size):
        notes.append(f"candidates above max_batch_size {p.max_batch_size} dropped: {above}")
    if over := sum(w for n, w in p.hist.items() if n > p.max_batch_size):
        notes.append(f"weight {over:g} of batches above max_batch_size {p.max_batch_size} always runs eagerly")
    caps = _kcap(cands, p.memory, budget)
    replay = [p.costs.replay(c) for c in cands]
    sizes = {n: w for n, w in p.hist.items() if w > 0}
    return _Table(cands, sizes, p.costs.eager, lambda j, _n: replay[j], 0.0, max(caps, default=0)), caps


def _prefill_table(p: PrefillProblem, budget: int, notes: list[str]) -> tuple[_Table, list[int]]:
    _check(budget, p.hist, "prefill")
    if p.slots < 1 or p.max_padding_ratio < 1 or p.ceiling < 1:
        raise ValueError("prefill planning needs ceiling >= 1, slots >= 1 and max_padding_ratio >= 1")
    cands = sorted({c for c in p.candidates if 1 <= c <= p.ceiling} | {p.ceiling})
    if p.ceiling not in p.candidates:
        notes.append(f"ceiling {p.ceiling} added to the candidates")
    if above := sorted(c for c in set(p.candidates) if c > p.ceiling):
        notes.append(f"candidates above the ceiling {p.ceiling} dropped: {above}")
    sizes: dict[int, float] = defaultdict(float)
    fixed = 0.0
    for (t, r), w in p.hist.items():
        if r > p.slots:
            fixed += w * p.costs.eager(t)
        elif w > 0:
            sizes[t] += w
    if fixed:
        notes.append(f"prefills with more than {p.slots} requests always run eagerly (too_many_requests)")
    if any(t > p.ceiling for t in sizes):
        notes.append(f"prefills above the ceiling {p.ceiling} tokens always run eagerly")
    caps = [0] * len(cands)
    if p.memory.ladder_bytes([p.ceiling]) <= budget:
        caps[-1] = _kcap(cands, p.memory, budget)[-1]  # the ceiling rule: it is always the largest kept
    else:
        notes.append(f"the ceiling {p.ceiling} alone needs {p.memory.ladder_bytes([p.ceiling])} bytes, over the "
                     f"budget of {budget}: no prefill graphs")
    replay = [p.costs.replay(c) for c in cands]
    eager = {t: p.costs.eager(t) for t in sizes}

    def served(j: int, t: int) -> float:
        return replay[j] if cands[j] <= p.max_padding_ratio * t else eager[t]

    return _Table(cands, sizes, p.costs.eager, served, fixed, max(caps)), caps


def _options(table: _Table, caps: list[int], allow_empty: bool) -> list[tuple[float, int, int]]:
    """(cost, largest index, count) of every ladder shape the budget allows, empty first."""
    out = [(table.cost(-1, 0), -1, 0)] if allow_empty else []
    out += [(table.cost(j, k), j, k) for j, cap in enumerate(caps) for k in range(1, cap + 1)]
    return out


def _plan(table: _Table, j: int, k: int, cost: float, memory: MemoryModel, notes: list[str]) -> Plan:
    ladder = table.ladder(j, k)
    dropped = sorted(set(table.cands) - set(ladder))
    if not ladder:
        notes.append("no graphs kept: every step runs eagerly")
    return Plan(ladder, cost, memory.ladder_bytes(ladder), dropped, notes)


def _best(options: list, key_bytes: Callable) -> tuple:
    """Least cost; among near-equal costs (float noise) the fewest bytes, then the fewest graphs."""
    least = min(o[0] for o in options)
    return min((o for o in options if o[0] <= least + _TOL * max(1.0, abs(least))), key=key_bytes)


def _single(table: _Table, caps: list[int], memory: MemoryModel, budget: int, allow_empty: bool,
            notes: list[str]) -> Plan:
    opts = _options(table, caps, allow_empty)  # never empty: [] or [ceiling] always fits
    while True:  # only loops for a ladder_bytes that depends on more than (largest, count)
        cost, j, k = _best(opts, lambda o: (memory.ladder_bytes(table.ladder(o[1], o[2])), o[2]))
        if memory.ladder_bytes(table.ladder(j, k)) <= budget:
            return _plan(table, j, k, cost, memory, notes)
        opts.remove((cost, j, k))


def plan_decode_ladder(hist: Mapping[int, float], candidates: Sequence[int], costs: StepCosts,
                       memory: MemoryModel, budget_bytes: int, max_batch_size: int) -> Plan:
    """The decode ladder (a subset of ``candidates`` up to ``max_batch_size``) minimising the
    objective of this module within ``budget_bytes``; may be empty (graphs off for decode).

    Exact: the resident model depends only on the largest kept bucket and the count, so a DP over
    "last kept bucket" (:class:`_Table`) is run once with counts up to the most the budget allows
    (K) and then every (largest, count) the budget admits is scored. With m candidates and S
    distinct sizes: O(m * S + K * m^2) time, O(K * m + m^2) memory.
    """
    p = DecodeProblem(hist, candidates, costs, memory, max_batch_size)
    notes: list[str] = []
    table, caps = _decode_table(p, budget_bytes, notes)
    return _single(table, caps, memory, budget_bytes, True, notes)


def plan_prefill_ladder(hist: Mapping[tuple[int, int], float], candidates: Sequence[int], costs: StepCosts,
                        memory: MemoryModel, budget_bytes: int, ceiling: int, slots: int,
                        max_padding_ratio: float) -> Plan:
    """The prefill token ladder minimising the objective under the runner's predicate (a pair
    replays only if ``requests <= slots`` and its bucket is ``<= max_padding_ratio * tokens``).

    Ceiling rule: ``ceiling`` is kept whenever it fits the budget alone (it removes the eager
    activation peak of the largest chunk), so it is always the largest kept bucket and only the
    count is searched; if it does not fit, the ladder is empty with a note. Same DP and
    complexity as :func:`plan_decode_ladder`.
    """
    p = PrefillProblem(hist, candidates, costs, memory, ceiling, slots, max_padding_ratio)
    notes: list[str] = []
    table, caps = _prefill_table(p, budget_bytes, notes)
    return _single(table, caps, memory, budget_bytes, caps[-1] == 0, notes)


def joint_bytes(decode_ladder: Sequence[int], decode_memory: MemoryModel, prefill_ladder: Sequence[int],
                prefill_memory: MemoryModel) -> int:
    """Modelled resident bytes of both ladders in the one process pool: the larger of the two
    largest shapes, plus the per-graph overhead of every other graph."""
    parts = [(m.shape_bytes(max(lad)), m.per_graph_overhead_bytes, len(lad))
             for lad, m in ((decode_ladder, decode_memory), (prefill_ladder, prefill_memory)) if lad]
    if not parts:
        return 0
    largest, owner_overhead = max((b, o) for b, o, _ in parts)
    return largest + sum(o * n for _, o, n in parts) - owner_overhead


def plan_ladders(decode: DecodeProblem, prefill: PrefillProblem, budget_bytes: int) -> JointPlan:
    """Both ladders under one budget, minimising decode cost + prefill cost (histograms recorded
    over the same window, so the sum is the window's forward time) subject to
    :func:`joint_bytes` <= ``budget_bytes``, with the prefill ceiling rule.

    Each phase's DP runs once under the whole budget (a phase alone never needs more than the
    pair); then every pair of (largest, count) options is scored, which covers both owners of
    the largest shape: O(m_d * K_d * K_p) pairs since the prefill largest is fixed by the rule.
    """
    dnotes: list[str] = []
    pnotes: list[str] = []
    dtable, dcaps = _decode_table(decode, budget_bytes, dnotes)
    ptable, pcaps = _prefill_table(prefill, budget_bytes, pnotes)
    dopts, popts = _options(dtable, dcaps, True), _options(ptable, pcaps, pcaps[-1] == 0)
    pairs = []
    for dcost, dj, dk in dopts:
        dlad = [dtable.cands[dj]] * dk  # joint_bytes depends on the largest and the count only
        for pcost, pj, pk in popts:
            total = joint_bytes(dlad, decode.memory, [ptable.cands[pj]] * pk, prefill.memory)
            if total <= budget_bytes:
                pairs.append((dcost + pcost, (dj, dk), (pj, pk), total))
    cost, (dj, dk), (pj, pk), total = _best(pairs, lambda o: (o[3], o[1][1] + o[2][1]))
    return JointPlan(_plan(dtable, dj, dk, dtable.cost(dj, dk), decode.memory, dnotes),
                     _plan(ptable, pj, pk, ptable.cost(pj, pk), prefill.memory, pnotes), cost, total)
