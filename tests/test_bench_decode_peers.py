"""bench/decode_peers.py's merge of per-batch peer children (stdlib only: runs on the CPU)."""

from __future__ import annotations

import sys

from bench.decode_peers import error_text, merge_results, run_peer, step_or_error


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


class _WrapperError(RuntimeError):
    """Raised by a compiler around the real failure, as inductor's BackendCompilerFailed is."""

    def __init__(self, inner: BaseException) -> None:
        super().__init__("backend='inductor' raised:\nlong traceback text")
        self.inner_exception = inner


def test_a_peer_error_names_its_root_cause_after_the_wrapper():
    try:
        try:
            raise AssertionError("PythonDispatcherTLS already set\nmore")
        except AssertionError as inner:
            raise _WrapperError(inner) from None
    except _WrapperError as e:
        assert error_text(e) == ("_WrapperError: backend='inductor' raised: <- "
                                 "AssertionError: PythonDispatcherTLS already set")
    try:
        try:
            {}["k"]
        except KeyError as inner:
            raise ValueError("bad config") from inner
    except ValueError as e:
        assert error_text(e) == "ValueError: bad config <- KeyError: 'k'"
    assert error_text(OSError("")) == "OSError: "
