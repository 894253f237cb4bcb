"""Capturing decode and prefill ladders under one graph-memory budget, guided by traffic.

Order of work (both phases share the process pool, so they share the budget):

1. Measure: capture each phase's largest shape into the shared pool (its growth is the
   shape's bytes; prefill first, so its ceiling reserves the blocks decode then reuses), a
   small shape after it (the per-graph overhead), and the small shape alone into a scratch pool.
   Time an eager forward and a replay at both sizes.
2. Plan: :func:`graphs.planner.plan_ladders` picks both ladders minimising expected padded work
   plus expected eager fallbacks (priced by the measured costs) for the traffic histogram (the
   loaded profile, else uniform over the candidates), within the budget, keeping the prefill
   ceiling whenever it fits.
3. Capture the chosen shapes largest first; before each one the predicted total must fit, and
   after it the measured total must too, else the shape is released, the rest of that phase is
   dropped and the log says so. Shapes measured in step 1 but not chosen are released.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphs.backends import create_backend
from graphs.decode import DecodeGraphRunner
from graphs.planner import (
    DecodeProblem,
    PrefillProblem,
    joint_bytes,
    plan_decode_ladder,
    plan_ladders,
    plan_prefill_ladder,
)
from graphs.prefill import PrefillGraphRunner
from graphs.process import release_warm_up_memory
from graphs.profile import BatchProfile, MemoryModel, StepCosts
from graphs.runner import GraphRunner

log = logging.getLogger(__name__)


@dataclass
class BudgetReport:
    """What a budgeted capture kept, dropped and measured."""

    budget_bytes: int
    resident_bytes: int = 0
    ladders: dict[str, list[int]] = field(default_factory=dict)
    dropped: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        kept = ", ".join(f"{p} {len(v)} shapes (max {max(v) if v else '-'})" for p, v in self.ladders.items())
        dropped = sum(len(v) for v in self.dropped.values())
        return (f"graph budget {self.budget_bytes / 2**20:.1f} MiB: {kept}; resident {self.resident_bytes / 2**20:.1f} "
                f"MiB" + (f"; {dropped} candidate shapes dropped" if dropped else ""))


@dataclass(frozen=True)
class ReplanSummary:
    """What a live re-plan (``worker.Worker.replan``) did: each phase's ladder before and after, the
    graphs' resident bytes against the budget, the seconds it took (measuring, capturing,
    releasing), and the padding the profile it planned from would replay per step under the old
    and the new ladders (decode: padded rows per decode step; prefill: padded tokens per prefill
    step)."""

    before: dict[str, list[int]]
    after: dict[str, list[int]]
    resident_bytes: int
    budget_bytes: int
    seconds: float
    padding_before: dict[str, float]
    padding_after: dict[str, float]
    line: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _time(fn: Callable[[], None], device: torch.device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@dataclass
class _Measured:
    memory: MemoryModel
    costs: StepCosts


def _measure(runner: GraphRunner) -> _Measured | None:
    """Capture the largest and a small shape (see module docstring); None if either failed."""
    large, small = runner.ladder[-1], runner.ladder[0]
    device = runner.backend.device
    eager = {}
    for size in {large, small}:
        fn = runner.capture_callable(size)
        eager[size] = _time(fn, device)
    for size in sorted({large, small}, reverse=True):
        if runner.capture_one(size) is None:
            return None
    replay = {}
    for size in {large, small}:
        runner.capture_callable(size)  # plans a padding batch of this shape: a replay reads the latest plan
        replay[size] = _time(lambda s=size: runner.backend.replay(s), device)
    large_bytes = runner.backend.shapes[large].resident_bytes
    overhead = runner.backend.shapes[small].resident_bytes if small != large else 0
    small_alone = large_bytes
    if small != large and device.type == "cuda":
        scratch = create_backend(runner.backend.name, device, pool=torch.cuda.graph_pool_handle(),
                                 warm_up_in_pool=runner.backend.warm_up_in_pool)
        shape = scratch.capture(small, runner.capture_callable(small), phase=runner.phase)
        small_alone = shape.resident_bytes
        scratch.release()
    elif small != large:
        small_alone = 0
    memory = MemoryModel(small, min(small_alone, large_bytes), large, large_bytes, overhead)
    if device.type != "cuda":
        # No graph to time off CUDA (the debug backend replays eagerly): price padded work, with
        # an eager step above any replay, so the plan follows the traffic alone.
        return _Measured(memory, StepCosts(lambda n: float(n + large), lambda b: float(b)))
    # A larger shape never costs less: timing noise must not make padding look free.
    for times in (eager, replay):
        times[large] = max(times[large], times[small])
    return _Measured(memory, StepCosts.fit(eager.items(), replay.items()))


def _uniform_decode(candidates: list[int]) -> dict[int, float]:
    return {n: 1.0 for n in range(1, candidates[-1] + 1)}


def _uniform_prefill(candidates: list[int], slots: int) -> dict[tuple[int, int], float]:
    return {(t, 1): 1.0 for t in candidates} | {(t, slots): 1.0 for t in candidates}


def capture_within_budget(decode: DecodeGraphRunner | None, prefill: PrefillGraphRunner | None,
                          budget_bytes: int | None, profile: BatchProfile | None = None,
                          default_ladders: dict[str, list[int]] | None = None) -> BudgetReport:
    """Measure, plan and capture both ladders within ``budget_bytes`` (see the module docstring).

    Each runner's ``ladder`` holds its candidate shapes on entry and the kept shapes on return.
    ``budget_bytes=None`` means "what ``default_ladders`` would cost": a profile then reshapes the
    ladders at equal graph memory.
    """
    runners = [r for r in (prefill, decode) if r is not None]
    measured = {r.phase: _measure(r) for r in runners}
    if budget_bytes is None:
        budget_bytes = _default_bytes(measured, default_ladders or {r.phase: r.ladder for r in runners})
    report = BudgetReport(budget_bytes)
    decode_problem = prefill_problem = None
    if decode is not None and measured["decode"] is not None:
        hist = dict(profile.decode) if profile and profile.decode_steps else _uniform_decode(decode.ladder)
        decode_problem = DecodeProblem(hist, list(decode.ladder), measured["decode"].costs,
                                       measured["decode"].memory, decode.ladder[-1])
    if prefill is not None and measured["prefill"] is not None:
        hist = dict(profile.prefill) if profile and profile.prefill_steps else _uniform_prefill(
            prefill.ladder, prefill.slots)
        prefill_problem = PrefillProblem(hist, list(prefill.ladder), measured["prefill"].costs,
                                         measured["prefill"].memory, prefill.ladder[-1], prefill.slots,
                                         prefill.max_padding_ratio)
    if decode_problem and prefill_problem:
        joint = plan_ladders(decode_problem, prefill_problem, budget_bytes)
        plans = {"decode": joint.decode, "prefill": joint.prefill}
    elif decode_problem:
        plans = {"decode": plan_decode_ladder(decode_problem.hist, decode_problem.candidates, decode_problem.costs,
                                              decode_problem.memory, budget_bytes, decode_problem.max_batch_size)}
    elif prefill_problem:
        p = prefill_problem
        plans = {"prefill": plan_prefill_ladder(p.hist, p.candidates, p.costs, p.memory, budget_bytes, p.ceiling,
                                                p.slots, p.max_padding_ratio)}
    else:
        plans = {}
    for runner in runners:
        plan = plans.get(runner.phase)
        keep = sorted(plan.ladder) if plan is not None else []
        report.notes += plan.notes if plan is not None else [f"{runner.phase}: measurement capture failed"]
        for size in list(runner.backend.shapes):
            if size not in keep:
                runner.backend.release_shape(size)
        kept = []
        for size in sorted(keep, reverse=True):
            if not runner.backend.has(size):
                if runner.capture_one(size) is None:
                    continue
            if _resident(runners) > budget_bytes:
                runner.backend.release_shape(size)
                report.notes.append(f"{runner.phase} shape {size} exceeded the budget when captured; "
                                    "it and every smaller unplanned shape run padded to a larger bucket or eagerly")
                break
            kept.append(size)
        report.dropped[runner.phase] = sorted(set(runner.ladder) - set(kept))
        report.ladders[runner.phase] = sorted(kept)
        if kept:
            runner.ladder = sorted(kept)
        else:
            runner.ladder = [runner.ladder[-1]]  # nothing captured: every pass reports not_captured
    report.resident_bytes = _resident(runners)
    if runners:
        release_warm_up_memory(runners[0].backend.device)
    log.info(report.line())
    for note in report.notes:
        log.info("graph plan: %s", note)
    return report


def _default_bytes(measured: dict[str, _Measured | None], ladders: dict[str, list[int]]) -> int:
    models = {phase: m.memory for phase, m in measured.items() if m is not None}
    dummy = MemoryModel(1, 0, 1, 0, 0)
    return joint_bytes(ladders.get("decode", []) if "decode" in models else [], models.get("decode", dummy),
                       ladders.get("prefill", []) if "prefill" in models else [], models.get("prefill", dummy))


def _resident(runners: list[GraphRunner]) -> int:
    return sum(r.backend.resident_bytes for r in runners)
