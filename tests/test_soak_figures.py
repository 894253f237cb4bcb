"""How bench/soak.py judges a greedy answer: token for token on the CPU, complete on a GPU (bf16)."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.soak import FaultRecord, Outcome, keep_outcomes, summarize, violations

REF = ["the fleet sails", "at dawn"]
MAX_TOKENS = 3


def _greedy(prompt: int, text: str, sent: float, *, tokens: int = MAX_TOKENS, finish: str = "length",
            status: int = 200, error: str | None = None) -> Outcome:
    return Outcome("greedy", True, prompt, sent, ended=sent + 1.0, status=status, text=text, finish_reason=finish,
                   error=error, token_times=[sent + 0.1, sent + 0.2, sent + 0.3], tokens=tokens)


def _figures(outcomes: list[Outcome], text_check: str) -> dict:
    fault = FaultRecord("kill", "decode", at=100.0, ready_again=110.0,  # window 100..115
                        hits=[{"t": 100.0, "actor": "graphfleet-soak-d0-0-rank0", "phase": "ready",
                              "signal": "SIGKILL"}])
    extra = {"pages_leaked": 0, "replica_restarts": 0, "rss_growth_mb": 0.0}
    return summarize(outcomes, REF, [fault], extra, MAX_TOKENS, text_check)


def test_exact_counts_a_different_text_as_lost():
    outcomes = [_greedy(0, REF[0], 10.0), _greedy(1, "at dusk", 105.0), _greedy(1, "at noon", 50.0)]
    f = _figures(outcomes, "exact")
    assert (f["greedy_complete"], f["greedy_equal"], f["lost"]) == (3, 1, 2)
    assert f["diverged"] == {"faults": 1, "clean": 1}
    assert "lost: 2" in violations(f, rss_growth_limit_mb=1.0)


def test_complete_counts_a_different_full_answer_as_diverged_not_lost():
    outcomes = [_greedy(0, REF[0], 10.0), _greedy(1, "at dusk", 105.0), _greedy(1, "at noon", 50.0)]
    f = _figures(outcomes, "complete")
    assert (f["lost"], f["diverged"]) == (0, {"faults": 1, "clean": 1})
    assert violations(f, rss_growth_limit_mb=1.0) == []
    assert f["ttft_p50_s"]["clean"] == pytest.approx(0.1)  # latencies of every complete answer


@pytest.mark.parametrize("text_check", ["exact", "complete"])
@pytest.mark.parametrize("broken", [
    {"tokens": MAX_TOKENS - 1},  # short: a stream cut where a re-prefill should have continued it
    {"tokens": None},  # no usage reported
    {"finish": "abort"},
    {"status": 500, "error": "engine failed"},
    {"error": "stream error"},
])
def test_an_incomplete_answer_is_lost_under_either_check(text_check, broken):
    f = _figures([_greedy(0, REF[0], 10.0, **broken)], text_check)
    assert f["lost"] == 1 and f["greedy_complete"] == 0


def test_given_up_and_hung_are_not_lost_but_hung_is_a_violation():
    gave_up = _greedy(0, "", 10.0, status=200, error="request given up after 3 attempts")
    hung = _greedy(1, "", 20.0, tokens=None)
    hung.hung = True
    f = _figures([gave_up, hung], "complete")
    assert (f["greedy_gave_up"], f["lost"], f["hung"]) == (1, 0, 1)
    assert violations(f, rss_growth_limit_mb=1.0) == ["hung: 1"]


def test_latencies_split_into_fault_windows_clean_and_steady():
    """Inside the window (100..115): faults. After it: clean, and steady only from 30 s after its end
    (a fault's backlog drains in between); before the first fault: clean and steady."""
    def stream(sent: float, ttft: float) -> Outcome:
        o = _greedy(0, REF[0], sent)
        o.token_times = [sent + ttft, sent + ttft + 0.01, sent + ttft + 0.02]
        return o

    f = _figures([stream(10.0, 0.1), stream(105.0, 9.0), stream(120.0, 5.0), stream(150.0, 0.2)], "complete")
    assert f["ttft_p50_s"]["faults"] == pytest.approx(9.0)
    assert sorted([f["ttft_p50_s"]["clean"], f["ttft_p99_s"]["clean"]]) == pytest.approx([0.2, 5.0])
    assert f["ttft_p99_s"]["steady"] == pytest.approx(0.2) and f["ttft_p50_s"]["steady"] == pytest.approx(0.1)
    assert f["tpot_p50_s"] == pytest.approx({"faults": 0.01, "clean": 0.01, "steady": 0.01})


def test_an_unknown_text_check_is_refused():
    with pytest.raises(ValueError, match="text_check must be one of"):
        _figures([], "roughly")


@pytest.mark.timeout(60)
def test_a_gpu_sized_soak_is_summarized_in_linear_time():
    """A 10-minute GPU soak ends with ~40,000 outcomes; list membership on them was quadratic (hours)."""
    n = 60_000
    outcomes = [_greedy(i % 2, REF[i % 2] if i % 3 else "elsewhere", float(i % 300)) for i in range(n)]
    f = _figures(outcomes, "exact")
    assert (f["greedy"], f["greedy_equal"], f["lost"]) == (n, n - n // 3, n // 3)


def test_the_raw_outcomes_come_back_before_the_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    fault = FaultRecord("kill", "decode", at=100.0, ready_again=110.0, hits=[])
    outcomes = [_greedy(0, REF[0], 10.0), _greedy(1, "at dusk", 105.0)]
    path = keep_outcomes(outcomes, [fault])
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f]
    assert lines[0]["fault"]["kind"] == "kill"
    back = [Outcome(**d) for d in lines[1:]]
    assert back == outcomes
    assert _figures(back, "exact")["lost"] == 1
