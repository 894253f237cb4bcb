"""bench/decode_peers.py's merge of per-batch peer children (stdlib only: runs on the CPU)."""

from __future__ import annotations

import sys

from bench.decode_peers import merge_results, run_peer, step_or_error


def _child(rows: str, code: int = 0) -> list[str]:
    code_text = f"import sys; print({rows!r}); sys.stderr.write('boom at the end\\n'); sys.exit({code})"
    return [sys.executable, "-c", code_text]


def test_a_failed_child_is_its_batch_row_and_the_others_keep_their_numbers():
    ok = run_peer("ours_compile", _child('{"peer": "ours_compile", "batch": 1, "step_s": 0.002}'), {}, 60, [1])
    failed = run_peer("ours_compile", _child("", 1), {}, 60, [64])
    merged = merge_results("ours_compile", [ok, failed])
    assert merged["batches"] == [1, 64] and merged["error"] is None
    assert step_or_error(merged, 1) == (0.002, None)
    step, error = step_or_error(merged, 64)
    assert step is None and error.startswith("ours_compile: exit status 1: boom at the end")


def test_when_every_child_fails_the_merged_result_carries_the_first_error():
    merged = merge_results("ours_compile", [run_peer("ours_compile", _child("", 3), {}, 60, [b]) for b in (1, 8)])
    assert merged["error"].startswith("ours_compile: exit status 3")
    assert [step_or_error(merged, b)[1].startswith("ours_compile: exit status 3") for b in (1, 8)] == [True, True]
