"""The graph runtime on CPU: buckets, fallback reasons, the debug backend's runner path, metrics."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from deploy.config import load_config
from graphs import breakable
from graphs.backends import DebugBackend, create_backend
from graphs.breakable import eager_break
from graphs.buckets import choose_bucket, default_decode_ladder
from graphs.decode import DecodeGraphRunner, LiveDecodeBatch
from graphs.eager import EagerRunner
from graphs.metrics import GraphMetrics
from tests.graph_harness import (
    RandomDecodeBatch,
    eager_logits,
    fill_cache_randomly,
    pad_decode_batch,
    random_decode_batch,
)
from tests.reference import OwnModel, rel_err
from worker.engine import Engine
from worker.model_steps import ModelDecodeStep
from worker.sampling.params import SamplingParams


def test_default_ladder_is_35_shapes_up_to_256():
    ladder = default_decode_ladder(256)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 256 and len(ladder) == 35
    assert default_decode_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert default_decode_ladder(3) == [1, 2, 3]


@pytest.mark.parametrize("padding", [True, False])
def test_bucket_and_reason_for_every_size(padding):
    ladder = default_decode_ladder(256)
    for n in range(1, 258):
        choice = choose_bucket(n, ladder, padding)
        if n > 256:
            assert (choice.size, choice.reason) == (None, "batch_too_large")
        elif n in ladder:
            assert (choice.size, choice.reason) == (n, None)
        elif padding:
            assert choice.size == min(b for b in ladder if b >= n) and choice.reason is None
        else:
            assert (choice.size, choice.reason) == (None, "padding_disabled")


@pytest.fixture(scope="module")
def own(checkpoint_dir):
    own = OwnModel(checkpoint_dir("tiny-llama"), num_pages=1024)
    fill_cache_randomly(own)
    return own


def _debug_runner(own, ladder, padding=True, metrics=None):
    step = ModelDecodeStep(own.model, own.attention, breakable=False)
    runner = DecodeGraphRunner(step, DebugBackend(torch.device("cpu")), ladder, padding, metrics)
    runner.capture_all(progress=False)
    return runner


def test_bf16_decode_logits_reach_the_float32_output_through_the_copy_alone(checkpoint_dir):
    """The decode step hands the runner logits in the model's dtype and the runner's copy into its
    float32 output is the cast: the same values as the eager path's float32 logits, bit for bit."""
    own = OwnModel(checkpoint_dir("tiny-llama"), dtype=torch.bfloat16, num_pages=256)
    fill_cache_randomly(own)
    runner = _debug_runner(own, [1, 2, 4, 8])
    rng = random.Random(3)
    for n in (1, 3, 8):
        batch = random_decode_batch(own, rng, n, 40)
        ids, pos = batch.live.input_ids, batch.live.positions
        own.attention.plan(batch.live.attention)
        raw = runner.step.forward(ids, pos)
        assert raw.dtype == torch.bfloat16 and runner.buffers.logits.dtype == torch.float32
        hidden = own.model(ids, pos, own.attention)
        assert own.model.compute_logits(hidden).dtype == torch.float32
        assert torch.equal(own.model.compute_logits(hidden, dtype=None).float(), own.model.compute_logits(hidden))
        if n in runner.ladder:  # no padding rows: the replay equals the eager float32 logits exactly
            assert torch.equal(runner.execute(batch.live, runner.decide(batch.live)), eager_logits(own, batch))


def test_runner_reasons_match_bucket_rules_and_capture_state(own):
    ladder = [1, 2, 4, 8]
    runner = _debug_runner(own, ladder)
    rng = random.Random(0)
    for n in range(1, 10):
        choice = runner.decide(random_decode_batch(own, rng, n, 40).live)
        assert choice == choose_bucket(n, ladder, True)
    runner.failed[4] = "simulated capture failure"
    assert runner.decide(random_decode_batch(own, rng, 3, 40).live).reason == "capture_failed"
    runner.backend.shapes.pop(8)
    assert runner.decide(random_decode_batch(own, rng, 8, 40).live).reason == "not_captured"


def test_debug_backend_equals_eager_exactly(own):
    """Same shape, same result: bit-exact against an eager forward of the padded batch built
    independently, bit-exact against the live batch when no padding is needed, and within fp32
    rounding of the unpadded eager forward otherwise (GEMMs of another height round differently)."""
    runner = _debug_runner(own, default_decode_ladder(32))
    rng = random.Random(1)
    for n in [1, 3, 7, 8, 13, 32, 5, 2, 31, 17]:
        batch = random_decode_batch(own, rng, n, 120)
        choice = runner.decide(batch.live)
        assert choice.replays and choice.size >= n
        pad = choice.size - n
        padded = RandomDecodeBatch(LiveDecodeBatch(
            torch.cat([batch.live.input_ids, torch.zeros(pad, dtype=torch.int64)]),
            torch.cat([batch.live.positions, torch.zeros(pad, dtype=torch.int64)]),
            pad_decode_batch(batch.live.attention, choice.size)), batch.seq_lens)
        ref_padded = eager_logits(own, padded)[:n]
        ref_live = eager_logits(own, batch)
        got = runner.execute(batch.live, choice)
        assert got.shape == ref_live.shape
        assert torch.equal(got, ref_padded), f"batch {n} padded to {choice.size}"
        if pad == 0:
            assert torch.equal(got, ref_live)
        assert rel_err(got, ref_live) <= 1e-5
        assert not runner.buffers.tokens.input_ids[n:choice.size].any()
        assert not runner.buffers.tokens.positions[n:choice.size].any()


def test_padding_rows_write_only_the_dummy_page(own):
    runner = _debug_runner(own, [8])
    rng = random.Random(2)
    batch = random_decode_batch(own, rng, 5, 60)
    own.cache.kv[:, 0].normal_()  # earlier padding rows left the same K/V there
    before = own.cache.kv.clone()
    runner.execute(batch.live, runner.decide(batch.live))
    changed = (own.cache.kv != before).flatten(2).any(-1).any(0)  # (pages,)
    changed_pages = set(changed.nonzero().flatten().tolist())
    live_last_pages = {t[(s - 1) // own.page_size] for t, s in zip(batch.live.attention.page_tables, batch.seq_lens)}
    assert changed_pages <= live_last_pages | {0}
    assert 0 in changed_pages  # the three padding rows wrote to the dummy page


def test_counters_move_as_expected(checkpoint_dir):
    registry = CollectorRegistry()
    path = checkpoint_dir("tiny-llama")
    engine = Engine(load_config(None, [f"model.path={path}", "graphs.debug=true",
                                       "graphs.decode.batch_sizes=[1,2,4]", "graphs.decode.max_batch_size=4"]),
                    registry=registry)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.generate([[5] * 7, [6] * 3, [9] * 4], params)  # 1 prefill + 4 decode steps of 3 rows (pad to 4)
    engine.generate([[5] * 7] * 5, params)  # 5 rows > 4: batch_too_large for 4 decode steps

    def value(name, **labels):
        return registry.get_sample_value(name, labels) or 0.0

    assert value("cuda_graph_passes_total", phase="decode", mode="decode_none") == 8
    assert value("cuda_graph_fallbacks_total", phase="decode", reason="debug") == 4
    assert value("cuda_graph_fallbacks_total", phase="decode", reason="batch_too_large") == 4
    assert value("cuda_graph_passes_total", phase="prefill", mode="prefill_none") == 2
    assert value("cuda_graph_shapes", phase="decode") == 3


def test_eager_engine_on_cpu_logs_why_graphs_are_off(checkpoint_dir, caplog):
    registry = CollectorRegistry()
    with caplog.at_level("INFO"):
        engine = Engine(load_config(None, [f"model.path={checkpoint_dir('tiny-llama')}"]), registry=registry)
    assert isinstance(engine.worker.runner.decode_runner, EagerRunner)
    assert "no CUDA device: CUDA graphs are off" in caplog.text
    engine.generate([[5] * 4], SamplingParams(max_tokens=3, ignore_eos=True))
    assert registry.get_sample_value("cuda_graph_fallbacks_total", {"phase": "decode", "reason": "no_cuda"}) == 2


def test_graph_backends_need_cuda():
    for name in ("full", "breakable"):
        with pytest.raises(ValueError, match="needs CUDA"):
            create_backend(name, torch.device("cpu"))
    with pytest.raises(ValueError, match="allowed: full, breakable, tc_piecewise, tc_full, debug"):
        create_backend("fast", torch.device("cpu"))
    for name in ("tc_piecewise", "tc_full"):  # compiled, no graphs
        backend = create_backend(name, torch.device("cpu"))
        assert not backend.is_graph and backend.name == name


def capturing() -> bool:
    """True inside an active breakable capture of this context."""
    return breakable._active.get() is not None


def test_eager_break_outside_capture_is_a_plain_call():
    calls = []

    @eager_break
    def record(out, x):
        calls.append(capturing())
        out.copy_(x * 2)

    out = torch.zeros(3)
    record(out, torch.ones(3))
    assert calls == [False] and torch.equal(out, torch.full((3,), 2.0))
    assert record.is_eager_break


def test_metrics_registry_injectable():
    a, b = CollectorRegistry(), CollectorRegistry()
    GraphMetrics(a).record_pass("decode", "full", None)
    GraphMetrics(b, labels={"rank": "1"}).record_pass("decode", "breakable", None)
    assert a.get_sample_value("cuda_graph_passes_total", {"phase": "decode", "mode": "decode_cuda_graph"}) == 1
    assert b.get_sample_value("cuda_graph_passes_total",
                              {"phase": "decode", "mode": "decode_breakable", "rank": "1"}) == 1
