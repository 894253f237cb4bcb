"""bench/decode_engine.py, the ``engine`` peer of bench/decode.py, on the CPU: our engine through
``generate``, timed per output token as the vLLM peer is, in a child run as decode.py runs it."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.decode_peers import run_peer, step_or_error

CHILD = Path(__file__).resolve().parents[1] / "bench" / "decode_engine.py"


def _engine_peer(model: Path, batches: list[int], *extra: str) -> dict:
    cmd = [sys.executable, str(CHILD), "--model", str(model), "--batches", ",".join(map(str, batches)),
           "--context", "24", "--repeats", "1", *extra]
    return run_peer("engine", cmd, {"PATH": "/usr/bin:/bin"}, 300, batches)


def test_the_engine_peer_gives_a_per_token_time_for_every_batch(two_layers):
    result = _engine_peer(two_layers, [1, 3])
    assert result["error"] is None, result
    for b in (1, 3):
        row = result["rows"][b]
        assert row["peer"] == "engine" and row["batch"] == b
        # 65 new tokens take longer than 1, and the difference per token is what the table shows
        assert row["t65_s"] > row["t1_s"] > 0
        assert step_or_error(result, b) == ((row["t65_s"] - row["t1_s"]) / 64, None)


def test_rows_cut_short_are_an_error_row_that_says_so(two_layers):
    # Three KV pages (two usable: 32 tokens) cannot hold 24 prompt tokens and 65 new ones: the engine
    # ends the rows early, and the peer reports that instead of a per-token time over fewer tokens.
    result = _engine_peer(two_layers, [2], "--num-pages", "3")
    step, error = step_or_error(result, 2)
    assert step is None and error.startswith("RuntimeError: asked for 65 tokens a row, got [")
