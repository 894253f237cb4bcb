"""bench.common.interleaved_wall_times: how bench/decode.py times its graph variants side by side."""

from __future__ import annotations

import statistics

import pytest

from bench.common import interleaved_wall_times


class DriftingMachine:
    """A clock that each call advances by its cost plus a slowdown that grows with every call made so
    far, as a device that heats up or a host that gets busier would."""

    def __init__(self, drift: float) -> None:
        self.now, self.calls, self.drift, self.log = 0.0, 0, drift, []

    def clock(self) -> float:
        return self.now

    def work(self, name: str, cost: float):
        def call() -> None:
            self.log.append(name)
            self.now += cost + self.drift * self.calls
            self.calls += 1
        return call


def test_each_round_calls_every_function_once_starting_one_later_and_syncs_after_each():
    m, synced = DriftingMachine(0.0), []
    fns = {name: m.work(name, 1.0) for name in "abc"}
    times = interleaved_wall_times(fns, repeats=2, sync=lambda: synced.append(m.log[-1]), warmup=1, clock=m.clock)
    assert m.log == list("abc" "bca" "cab")
    assert synced == m.log  # a sync after every call, before its time is read
    assert {name: len(t) for name, t in times.items()} == {"a": 2, "b": 2, "c": 2}
    assert all(t == 1.0 for ts in times.values() for t in ts)


def test_drift_falls_on_every_function_alike():
    # Two identical functions on a machine that slows down by 0.01 s a call: timed one after the other
    # the second looks 0.3 s slower (30 calls later); interleaved, their medians differ by at most one
    # call's drift, and a function that really costs 0.1 s more shows as such.
    repeats = 30
    m = DriftingMachine(0.01)
    one_after_other = {name: interleaved_wall_times({name: m.work(name, 1.0)}, repeats, lambda: None, 0, m.clock)
                       for name in ("x", "y")}
    assert statistics.median(one_after_other["y"]["y"]) - statistics.median(one_after_other["x"]["x"]) >= 0.29
    m = DriftingMachine(0.01)
    times = interleaved_wall_times({"x": m.work("x", 1.0), "y": m.work("y", 1.0), "z": m.work("z", 1.1)},
                                   repeats, lambda: None, 0, m.clock)
    med = {name: statistics.median(t) for name, t in times.items()}
    assert abs(med["x"] - med["y"]) <= 0.01 + 1e-9
    assert 0.08 <= med["z"] - med["x"] <= 0.12


def test_bad_counts_are_refused_by_name():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        interleaved_wall_times({"a": lambda: None}, repeats=0, sync=lambda: None)
    with pytest.raises(ValueError, match="warmup >= 0"):
        interleaved_wall_times({"a": lambda: None}, repeats=1, sync=lambda: None, warmup=-1)
    assert interleaved_wall_times({}, repeats=3, sync=lambda: None) == {}
