"""bench/capture.py's serving history (CPU): the prefill steps its ``--served`` runs replay."""

from __future__ import annotations

from bench.capture import served_history


def test_a_serving_history_fits_the_chunk_the_request_slots_and_the_positions():
    steps = served_history(2000, 8192, 2048, seed=3)
    assert all(1 <= sum(s) <= 8192 for s in steps)
    assert all(1 <= len(s) <= 16 for s in steps)
    assert all(1 <= n <= 2048 for s in steps for n in s)
    totals = sorted(sum(s) for s in steps)
    assert totals[len(totals) // 10] < 1500 and totals[-len(totals) // 10] > 6500  # every size, not one
    assert len({len(s) for s in steps}) == 16


def test_a_serving_history_is_the_same_for_every_configuration():
    assert served_history(50, 4096, 1024) == served_history(50, 4096, 1024)
    assert served_history(50, 4096, 1024, seed=1) != served_history(50, 4096, 1024)
    assert all(max(s) <= 1024 for s in served_history(500, 4096, 1024))
