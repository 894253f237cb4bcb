"""Profile export and profile-guided ladders, end to end on CPU (debug backend)."""

from __future__ import annotations

import json
import subprocess
import sys

from deploy.config import load_config
from graphs.profile import BatchProfile
from worker.engine import Engine
from worker.traces import load_trace, run_trace, skewed_trace


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy", "--log-level", "WARNING", *args],
                          capture_output=True, text=True, timeout=300, check=False)


def save_trace(trace: list[dict], path) -> None:
    """Write ``trace`` in the JSON-lines form :func:`worker.traces.load_trace` reads."""
    path.write_text("".join(json.dumps(t) + "\n" for t in trace))


def test_skewed_trace_is_deterministic_and_skewed(tmp_path):
    a, b = skewed_trace(200, seed=3), skewed_trace(200, seed=3)
    assert a == b and a != skewed_trace(200, seed=4)
    short = sum(70 <= r["prompt_len"] <= 110 for r in a) / len(a)
    assert short > 0.5
    save_trace(a, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == a


def test_profile_export_cli_then_profile_guided_start(checkpoint_dir, tmp_path):
    path = checkpoint_dir("tiny-llama")
    common = ["--set", "scheduler.max_running_requests=48", "--set", "scheduler.chunked_prefill_size=1024",
              "--set", "graphs.prefill.max_tokens=1024", "--set", "graphs.decode.max_batch_size=48"]
    out = tmp_path / "profile.json"
    res = _cli("profile", "export", "--model", str(path), "--requests", "120", "--out", str(out), *common)
    assert res.returncode == 0, res.stderr
    profile = BatchProfile.load(out)
    assert profile.decode_steps > 50 and profile.prefill_steps > 5
    assert json.loads(out.read_text())["version"] == 1

    engine = Engine(load_config(None, [f"model.path={path}", "graphs.debug=true", f"graphs.profile={out}",
                                       "scheduler.max_running_requests=48", "scheduler.chunked_prefill_size=1024",
                                       "graphs.prefill.max_tokens=1024", "graphs.decode.max_batch_size=48"]))
    decode = engine.worker.runner.decode_runner
    prefill = engine.worker.runner.prefill_runner
    assert prefill.ladder[-1] == 1024  # the ceiling is kept
    top = sorted(profile.decode, key=profile.decode.get, reverse=True)[:3]
    assert all(n in decode.ladder for n in top)  # the most frequent batch sizes replay unpadded
    run_trace(engine, skewed_trace(40, seed=9))
    again = engine.worker.profile()
    assert again.decode_steps > 0


def test_bad_profile_file_is_named(checkpoint_dir, tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"version": 7, "decode": {}, "prefill": {}}))
    res = _cli("generate", "--model", str(checkpoint_dir("tiny-llama")), "--prompt-ids", "1,2",
               "--set", "graphs.debug=true", "--set", f"graphs.profile={bad}")
    assert res.returncode == 2 and "version" in res.stderr and "Traceback" not in res.stderr


def test_live_replan_between_steps_keeps_requests_correct(checkpoint_dir):
    from prometheus_client import CollectorRegistry

    from worker.sampling.params import SamplingParams

    path = checkpoint_dir("tiny-llama")
    overrides = [f"model.path={path}", "scheduler.max_running_requests=16", "scheduler.chunked_prefill_size=512",
                 "graphs.prefill.max_tokens=512", "graphs.decode.max_batch_size=16"]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [[5 + i] * (10 + 7 * i) for i in range(6)]
    expected = [o.token_ids for o in Engine(load_config(None, overrides)).generate(prompts, params)]
    registry = CollectorRegistry()
    engine = Engine(load_config(None, [*overrides, "graphs.debug=true"]), registry=registry)
    old_ladder = list(engine.worker.runner.decode_runner.ladder)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(6):
        engine.step()
    profile = BatchProfile(decode={6: 100, 3: 5})
    assert engine.in_flight  # async scheduling: a step is sent and not read back
    outcome = engine.replan(profile)
    assert outcome.error is None and not engine.in_flight and outcome.events  # read back before the swap
    summary = outcome.summary
    assert "graph budget" in summary.line and summary.seconds > 0
    assert 6 in engine.worker.runner.decode_runner.ladder and engine.worker.runner.decode_runner.ladder != old_ladder
    new_ladder = engine.worker.runner.decode_runner.ladder
    assert summary.before["decode"] == old_ladder and summary.after["decode"] == new_ladder
    # the profile's batches of 6 and 3 now replay unpadded
    assert summary.padding_after["decode"] == 0 < summary.padding_before["decode"]
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(i).token_ids for i in ids] == expected
    assert registry.get_sample_value("cuda_graph_replans_total") == 1
