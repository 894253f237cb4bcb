"""The ladders a worker's phase runners hold, and the padding a batch profile replays under them.

What :meth:`worker.worker.Worker.replan` reports (padding per step before and after) and what an
automatic re-plan judges (:meth:`worker.worker.Worker.padding_since_plan`) are both
:func:`graphs.planner.replayed_padding` of a profile under a worker's ladders; this module turns
a worker's runners into that function's arguments.
"""

from __future__ import annotations

import math

from graphs.eager import EagerRunner
from graphs.planner import padding_share, replayed_padding
from graphs.prefill import PrefillGraphRunner
from graphs.profile import BatchProfile
from graphs.runner import GraphRunner


def graph_runners(*runners: GraphRunner | EagerRunner) -> list[GraphRunner]:
    """The runners among ``runners`` that capture graphs (in order)."""
    return [r for r in runners if isinstance(r, GraphRunner)]


def ladders_of(prefill: GraphRunner | EagerRunner, decode: GraphRunner | EagerRunner) -> dict[str, list[int]]:
    """The ladder of each phase that has graphs."""
    return {r.phase: list(r.ladder) for r in graph_runners(prefill, decode)}


def padding_per_step(profile: BatchProfile, ladders: dict[str, list[int]],
                     prefill: GraphRunner | EagerRunner) -> dict[str, float]:
    """Padded rows per decode step and padded tokens per prefill step ``profile`` replays under ``ladders``."""
    return {phase: padded / steps
            for phase, (padded, _, steps) in replayed_padding(profile, *_padding_args(ladders, prefill)).items()}


def padding_share_of(profile: BatchProfile, ladders: dict[str, list[int]],
                     prefill: GraphRunner | EagerRunner) -> dict[str, tuple[float, int]]:
    """:func:`graphs.planner.padding_share` of ``profile`` under ``ladders``."""
    return padding_share(profile, *_padding_args(ladders, prefill))


def _padding_args(ladders: dict[str, list[int]], prefill: GraphRunner | EagerRunner) -> tuple:
    """``(decode ladder, prefill ladder, slots, max_padding_ratio)``: the prefill runner's request
    slots and padding limit, its phase only if it has graphs."""
    if isinstance(prefill, PrefillGraphRunner):
        return ladders.get("decode"), ladders.get("prefill"), prefill.slots, prefill.max_padding_ratio
    return ladders.get("decode"), None, 1, math.inf
