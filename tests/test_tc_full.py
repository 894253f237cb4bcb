"""tc_full on CPU: the compiled decode forward through the decode runner against eager, its two
compiles (batch 1 and the rest) done before any warm-up, the fallback when the compile fails, and
the worker wiring. No CUDA here: the compiled forward runs without graphs."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from deploy.config import load_config
from graphs.backends import create_backend
from graphs.decode import DecodeGraphRunner
from graphs.metrics import GraphMetrics
from tests.graph_harness import eager_logits, fill_cache_randomly, random_decode_batch
from tests.reference import OwnModel, rel_err
from worker.engine import Engine
from worker.model_steps import CompiledDecodeStep
from worker.sampling.params import SamplingParams

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # compiled code is process-wide
LADDER = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def own(two_layers):
    own = OwnModel(two_layers, num_pages=512)
    fill_cache_randomly(own)
    return own


class _BreakingDecodeStep(CompiledDecodeStep):
    """A forward that dynamo cannot trace whole: ``fullgraph=True`` makes its compile fail."""

    def _traced_forward(self, input_ids, positions):
        torch._dynamo.graph_break()
        return super()._traced_forward(input_ids, positions)


def test_tc_full_decode_equals_eager_through_the_runner(own):
    step = CompiledDecodeStep(own.model, own.attention, compiler="eager")
    backend = create_backend("tc_full", CPU)
    runner = DecodeGraphRunner(step, backend, LADDER, True)
    runner.capture_all(progress=False)
    assert not runner.failed and sorted(backend.shapes) == LADDER
    # One compile for every batch of two rows or more, one for batch 1, timed by the backend.
    assert step.compiled.compiles == 2
    assert backend.stats()["compiles"] == 2 and backend.compile_seconds > 0
    assert step.compile_error is None
    rng = random.Random(7)
    for n in (1, 2, 3, 5, 8):
        batch = random_decode_batch(own, rng, n, 60)
        choice = runner.decide(batch.live)
        got = runner.execute(batch.live, choice).clone()
        ref = eager_logits(own, batch)
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert rel_err(got, ref) < 1e-5, f"batch {n}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert step.compiled.compiles == 2  # no recompile for live batches


def test_a_failed_compile_falls_back_to_the_uncompiled_forward_once(own):
    failures = []
    step = _BreakingDecodeStep(own.model, own.attention, compiler="eager")
    step.on_compile_failure = failures.append
    runner = DecodeGraphRunner(step, create_backend("tc_full", CPU), LADDER, True)
    runner.capture_all(progress=False)
    assert not runner.failed  # every shape captured, with the plain forward
    assert len(failures) == 1 and "Unsupported" in failures[0] and step.compile_error == failures[0]
    assert step.compiled.compiles == 0
    rng = random.Random(8)
    for n in (1, 4, 7):
        batch = random_decode_batch(own, rng, n, 60)
        got = runner.execute(batch.live, runner.decide(batch.live))
        ref = eager_logits(own, batch)
        assert rel_err(got, ref) < 1e-5
    assert len(failures) == 1  # reported once, never traced again


@pytest.mark.slow  # two inductor compiles of a two-layer decode forward
def test_worker_wires_tc_full_and_generates_as_eager(two_layers):
    registry = CollectorRegistry()
    overrides = [f"model.path={two_layers}", "graphs.debug=false", "graphs.decode.batch_sizes=[1,2,4]",
                 "graphs.decode.max_batch_size=4", "cache.num_pages=256"]
    tc = Engine(load_config(None, [*overrides, "graphs.decode.backend=tc_full"]), registry=registry)
    runner = tc.worker.runner.decode_runner
    assert runner.backend.name == "tc_full" and sorted(runner.backend.shapes) == [1, 2, 4]
    assert runner.step.compiled.compiles == 2
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = Engine(load_config(None, overrides)).generate(prompts, params)
    assert [o.token_ids for o in tc.generate(prompts, params)] == [o.token_ids for o in ref]

    def passes(reason):
        return registry.get_sample_value("cuda_graph_fallbacks_total", {"phase": "decode", "reason": reason}) or 0

    assert passes("tc_full") >= 5  # off CUDA the compiled forward runs without graphs
    # The worker's answer to a failed compile: the backend is renamed to what it now captures,
    # the failure is counted, and a re-plan builds the plain backend instead of compiling again.
    runner.step.on_compile_failure("BackendCompilerFailed: boom")
    assert runner.backend.name == "debug"
    assert registry.get_sample_value("cuda_graph_compile_failures_total",
                                     {"phase": "decode", "fallback": "debug"}) == 1
    runner.step.compile_error = "BackendCompilerFailed: boom"
    rebuilt = tc.worker._build_decode_runner(planner_candidates=False)
    assert rebuilt.backend.name == "debug" and not isinstance(rebuilt.step, CompiledDecodeStep)
    assert [o.token_ids for o in tc.generate(prompts, params)] == [o.token_ids for o in ref]
    tc.shutdown()


def test_metrics_export_compile_failures_with_their_fallback():
    registry = CollectorRegistry()
    GraphMetrics(registry, {"rank": "0"}).record_compile_failure("decode", "full")
    assert registry.get_sample_value("cuda_graph_compile_failures_total",
                                     {"phase": "decode", "fallback": "full", "rank": "0"}) == 1
