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


def test_step_wait_counters_reach_metrics_text_and_the_bench_reads_them_back():
    """A rank's read-back waits as counters, labelled as the rank's metrics are; the bench's parser
    reads them back from the text: the loop's core share while it waits is their ratio."""
    from prometheus_client import CollectorRegistry, generate_latest

    from bench.serve import step_wait_totals
    from worker.step_wait_metrics import StepWaitMetrics

    registry = CollectorRegistry()
    metrics = StepWaitMetrics(registry, {"group": "g0", "rank": "0", "role": "both"})
    assert step_wait_totals(generate_latest(registry).decode()) == {"wait_s": 0.0, "cpu_s": 0.0}  # before a step
    metrics.record(0.004, 0.0005)
    metrics.record(0.002, 0.0001)
    metrics.record(0.003, -1.0)  # a clock that stepped back counts nothing
    totals = step_wait_totals(generate_latest(registry).decode())
    assert totals["wait_s"] == pytest.approx(0.009) and totals["cpu_s"] == pytest.approx(0.0006)
    assert registry.get_sample_value("graphfleet_step_wait_cpu_seconds_total",
                                     {"group": "g0", "rank": "0", "role": "both"}) == pytest.approx(0.0006)


def test_a_local_worker_exports_its_step_waits(checkpoint_dir):
    from prometheus_client import CollectorRegistry

    from deploy.config import load_config
    from worker.engine import Engine
    from worker.sampling.params import SamplingParams

    registry = CollectorRegistry()
    engine = Engine(load_config(None, [f"model.path={checkpoint_dir('tiny-llama')}", "cache.num_pages=64"]),
                    registry=registry)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    # On CPU a step has run when launch returns: nothing is waited for, and the counters say so.
    assert registry.get_sample_value("graphfleet_step_wait_seconds_total") == 0.0
    assert registry.get_sample_value("graphfleet_step_wait_cpu_seconds_total") == 0.0
