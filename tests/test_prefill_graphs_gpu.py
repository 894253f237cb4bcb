"""Prefill graphs on the GPU: breakable and full against eager on random slot batches."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from graphs.backends import create_backend
from graphs.metrics import GraphMetrics
from graphs.prefill import LivePrefillBatch, PrefillGraphRunner, default_prefill_ladder
from tests.graph_harness import eager_hidden, fill_cache_randomly, random_prefill_batch
from tests.reference import OwnModel, rel_l2
from worker.attention.factory import flashinfer_importable
from worker.graph_steps import ModelPrefillStep
from worker.model.kernels import select_kernels

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SLOTS, CEILING = 4, 2048


def _own(checkpoint_dir, attention: str) -> OwnModel:
    if attention == "flashinfer" and not flashinfer_importable():
        pytest.skip("flashinfer not installed")
    own = OwnModel(checkpoint_dir("tiny-llama"), dtype=torch.bfloat16, device="cuda", backend=attention,
                   num_pages=4096, kernels=select_kernels(CUDA, prefer_fused=attention == "flashinfer"),
                   max_rows=64, max_pages_per_row=256)
    fill_cache_randomly(own)
    return own


@pytest.mark.parametrize("backend,attention", [("breakable", "torch"), ("breakable", "flashinfer"),
                                               ("full", "flashinfer")])
def test_200_random_prefill_batches_match_eager(backend, attention, checkpoint_dir):
    own = _own(checkpoint_dir, attention)
    registry = CollectorRegistry()
    step = ModelPrefillStep(own.model, own.attention, breakable=backend == "breakable")
    runner = PrefillGraphRunner(step, create_backend(backend, CUDA), default_prefill_ladder(CEILING), SLOTS,
                                2.0, GraphMetrics(registry), torch.bfloat16)
    runner.capture_all(progress=False)
    assert not runner.failed, runner.failed
    rng = random.Random(0)
    replayed = 0
    for i in range(200):
        requests = rng.randint(1, SLOTS + 1)
        batch = random_prefill_batch(own, rng, requests, CEILING // SLOTS - 64, max_prefix=300 if i % 3 else 0)
        live = batch.live
        ref = eager_hidden(own, live).clone()
        last = torch.tensor(live.attention.query_lens, device="cuda").cumsum(0) - 1
        ref_logits = own.model.compute_logits(ref[last])
        ref_tokens = ref_logits.argmax(-1)
        choice = runner.decide(live)
        if requests > SLOTS:
            assert choice.reason == "too_many_requests"
            runner.record_eager(choice.reason)
            continue
        if not choice.replays:
            assert choice.reason in ("padding_waste",), choice.reason
            continue
        got = runner.execute(live, choice)
        replayed += 1
        assert rel_l2(got, ref) <= 2e-2, f"batch {i}: {requests} requests, {live.num_tokens} tokens"
        tokens = own.model.compute_logits(got[last]).argmax(-1)
        for row in (tokens != ref_tokens).nonzero().flatten().tolist():  # only bf16 near-ties may differ
            margin = (ref_logits[row, ref_tokens[row]] - ref_logits[row, tokens[row]]).item()
            assert margin <= 0.25, f"batch {i}: first token of request {row} differs by a clear margin"
    assert replayed >= 100
    assert registry.get_sample_value("cuda_graph_fallbacks_total",
                                     {"phase": "prefill", "reason": "too_many_requests"}) >= 1
    mode = "prefill_cuda_graph" if backend == "full" else "prefill_breakable"
    assert registry.get_sample_value("cuda_graph_passes_total", {"phase": "prefill", "mode": mode}) == replayed
    runner.release()


@pytest.mark.parametrize("backend,attention", [("breakable", "torch"), ("full", "flashinfer")])
def test_sentinels_write_no_kv_outside_live_pages(backend, attention, checkpoint_dir):
    own = _own(checkpoint_dir, attention)
    step = ModelPrefillStep(own.model, own.attention, breakable=backend == "breakable")
    runner = PrefillGraphRunner(step, create_backend(backend, CUDA), [256, 512], SLOTS, 100.0)
    runner.capture_all(progress=False)
    rng = random.Random(1)
    for requests in (1, 2, SLOTS):
        batch = random_prefill_batch(own, rng, requests, 100, max_prefix=50)
        before = own.cache.kv.clone()
        runner.execute(batch.live, runner.decide(batch.live))
        torch.cuda.synchronize()
        untouched = [p for p in range(1, own.cache.num_pages) if p not in batch.pages]
        assert torch.equal(own.cache.kv[:, untouched], before[:, untouched])
    runner.release()


def test_full_prefill_refuses_a_non_graph_safe_attention_backend(checkpoint_dir):
    own = _own(checkpoint_dir, "torch")
    with pytest.raises(ValueError, match="graph-safe prefill attention backend.*breakable"):
        ModelPrefillStep(own.model, own.attention, breakable=False)


def test_live_batch_helper_shapes():
    live = LivePrefillBatch(torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), None, 2)
    assert live.num_tokens == 5
