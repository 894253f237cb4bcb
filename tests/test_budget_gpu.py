"""Graph memory budgets on the GPU: capture within half the full ladder, re-plan while serving."""

from __future__ import annotations

import pytest
import torch

from deploy.config import load_config
from graphs.profile import BatchProfile
from worker.engine import Engine
from worker.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu

OVERRIDES = ["attention.backend=torch", "scheduler.max_running_requests=64", "graphs.decode.max_batch_size=64",
             "scheduler.chunked_prefill_size=1024", "graphs.prefill.max_tokens=1024", "cache.num_pages=2048"]


def _graph_bytes(engine: Engine) -> int:
    r = engine.worker.runner
    return r.decode_runner.resident_bytes + r.prefill_runner.resident_bytes


@pytest.mark.timeout(900)
def test_half_budget_keeps_ceiling_and_replan_stays_within(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    full = Engine(load_config(None, [f"model.path={path}", *OVERRIDES]))
    full_bytes = _graph_bytes(full)
    assert full_bytes > 0
    full.shutdown()
    del full
    torch.cuda.empty_cache()

    budget = full_bytes // 2
    engine = Engine(load_config(None, [f"model.path={path}", *OVERRIDES, f"graphs.memory_budget={budget}"]))
    runner = engine.worker.runner
    assert _graph_bytes(engine) <= budget
    assert runner.prefill_runner.ladder[-1] == 1024 and runner.prefill_runner.backend.has(1024)

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[5 + i] * (20 + 9 * i) for i in range(8)]
    reference = Engine(load_config(None, [f"model.path={path}", *OVERRIDES, "graphs.enabled=false"]))
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(5):
        engine.step()
    # The re-plan gets the room the old graphs leave: with a budget of half the full ladder,
    # the old ladder already holds close to it, so the re-plan must refuse and change nothing.
    before = list(runner.decode_runner.ladder)
    try:
        engine.worker.replan(BatchProfile(decode={8: 100}, prefill={(200, 1): 10}))
        replanned = True
    except ValueError as e:
        assert "re-plan refused" in str(e)
        assert engine.worker.runner is runner and runner.decode_runner.ladder == before
        replanned = False
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(i).token_ids for i in ids] == expected
    assert _graph_bytes(engine) <= budget
    assert replanned == (engine.worker.runner is not runner)
