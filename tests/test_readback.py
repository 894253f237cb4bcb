"""worker.readback: the read-back's expected step durations do not drift with the host's oversleep."""

from __future__ import annotations

import random

import pytest

from worker.readback import _SLEEP_MARGIN_S, next_expected


def _serve(step_s: float, oversleep_s: float, steps: int, rule) -> float:
    """A loop of one shape: nap until expected - margin (waking ``oversleep`` late), then spin."""
    rng = random.Random(0)
    expected = None
    for _ in range(steps):
        nap_end = None if expected is None else expected - _SLEEP_MARGIN_S + rng.uniform(0, oversleep_s)
        if nap_end is not None and nap_end >= step_s:
            expected = rule(expected, nap_end, True)  # the step was done before the nap ended
        else:
            expected = rule(expected, step_s, False)
    return expected


@pytest.mark.parametrize("oversleep_ms", [0.0, 0.1, 0.5, 2.0])
def test_expected_duration_stays_near_the_step_whatever_the_oversleep(oversleep_ms):
    step = 0.002
    expected = _serve(step, oversleep_ms / 1e3, 5000, next_expected)
    assert step - oversleep_ms / 1e3 - 2 * _SLEEP_MARGIN_S <= expected <= step + 2 * _SLEEP_MARGIN_S


def test_learning_the_nap_itself_would_drift():
    """What the rule guards against: a step that ended during the nap learned as lasting the nap."""
    def naive(expected, took, overslept):
        return took if expected is None else 0.8 * expected + 0.2 * took
    assert _serve(0.002, 0.001, 5000, naive) > 0.1  # 2 ms steps "expected" to last 100+ ms
