"""bench/capture.py on the CPU: the prefill steps its ``--served`` runs replay, and its configurations."""

from __future__ import annotations

import pytest

from bench.capture import parse_config, served_history


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


def test_a_configuration_fills_decode_and_the_lm_head_stream_and_names_what_is_wrong():
    assert parse_config("none:none:-") == ("none", "none", "-", "-", "compute")
    assert parse_config("full:8192:pool:graphs") == ("full", "8192", "pool", "graphs", "graph")
    assert parse_config("breakable:8192:pool:-:capture") == ("breakable", "8192", "pool", "-", "capture")
    assert parse_config("breakable:8192:pool:-:compute") == ("breakable", "8192", "pool", "-", "compute")
    for spec, named in (("full:8192", "backend:ceiling:warm_up"), ("full:8192:pool:-:capture:x", "backend:ceiling"),
                        ("full:8192:pool:both", "'both'"), ("full:8192:pool:-:side", "'side'"),
                        ("none:none:-:-:graph", "'graph'")):
        with pytest.raises(ValueError, match=named):
            parse_config(spec)
