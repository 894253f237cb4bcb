"""Graph memory on the GPU: warm-ups inside the graph pool, the leak check, KV pages with graphs on."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from deploy.config import load_config
from graphs.backends import WarmUpLeakError, create_backend
from graphs.prefill import PrefillGraphRunner, default_prefill_ladder
from graphs.process import graph_pool, pool_bytes
from tests.graph_harness import eager_hidden, fill_cache_randomly, random_prefill_batch
from tests.reference import OwnModel, rel_l2
from worker.attention.factory import flashinfer_importable
from worker.engine import Engine
from worker.kv_cache import KVCacheShape
from worker.model.kernels import select_kernels
from worker.model_steps import ModelPrefillStep

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SLOTS, CEILING = 4, 4096


def _settle() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def _own_model(checkpoint_dir) -> OwnModel:
    if not flashinfer_importable():
        pytest.skip("flashinfer not installed")
    own = OwnModel(checkpoint_dir("tiny-llama"), dtype=torch.bfloat16, device="cuda", backend="flashinfer",
                   num_pages=4096, kernels=select_kernels(CUDA), max_rows=64, max_pages_per_row=512)
    fill_cache_randomly(own)
    return own


def _prefill_step(checkpoint_dir, backend: str) -> tuple[OwnModel, ModelPrefillStep]:
    own = _own_model(checkpoint_dir)
    return own, ModelPrefillStep(own.model, own.attention, breakable=backend == "breakable")


def _check_replays_equal_eager(own: OwnModel, runner: PrefillGraphRunner, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(20):
        live = random_prefill_batch(own, rng, SLOTS, CEILING // SLOTS - 64, max_prefix=200).live
        ref = eager_hidden(own, live).clone()
        choice = runner.decide(live)
        if choice.replays:
            assert rel_l2(runner.execute(live, choice), ref) <= 2e-2


@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_warm_ups_in_the_pool_hold_no_second_activation_peak(backend, checkpoint_dir):
    """Side by side on one model: with warm-ups outside the pool the capture's peak is the pool
    plus a warm-up's activations; inside it the peak is about the pool, and replays still equal eager."""
    own, step = _prefill_step(checkpoint_dir, backend)
    measured = {}
    for in_pool in (False, True):
        pool = torch.cuda.graph_pool_handle()  # a pool of this measurement's own
        runner = PrefillGraphRunner(step, create_backend(backend, CUDA, pool=pool, warm_up_in_pool=in_pool),
                                    default_prefill_ladder(CEILING), SLOTS, 2.0, None, torch.bfloat16)
        start = _settle()
        torch.cuda.reset_peak_memory_stats()
        runner.capture_all(progress=False)
        assert not runner.failed, runner.failed
        peak = torch.cuda.max_memory_reserved() - start
        held = pool_bytes(pool)
        assert runner.resident_bytes == held  # every byte of the pool is counted to a shape
        measured[in_pool] = (peak, held)
        if in_pool:
            _check_replays_equal_eager(own, runner, 1)
        runner.release()
        del runner
    (out_peak, out_pool), (in_peak, in_pool_bytes) = measured[False], measured[True]
    print(f"{backend}: warm-ups outside the pool: peak {out_peak / 2**20:.1f} MiB, pool {out_pool / 2**20:.1f} MiB; "
          f"inside: peak {in_peak / 2**20:.1f} MiB, pool {in_pool_bytes / 2**20:.1f} MiB")
    assert in_peak < out_peak
    # Inside the pool the peak is the pool, or the first warm-up's transient if that is larger.
    assert in_peak <= max(in_pool_bytes, out_peak - out_pool) + 64 * 2**20


@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_mlp_row_chunks_shrink_the_prefill_pool_and_replays_still_equal_eager(backend, checkpoint_dir):
    """graphs.prefill.mlp_chunk_tokens side by side on one model, each in a fresh pool: with the MLP
    over chunks of 256 tokens a 4096-token ceiling's captures have a lower live peak (the whole MLP's
    gate/up and SiLU activations are 8 + 4 MiB on this model; the peak moves to attention: 18 -> 12 MiB
    on an H100), every byte counts to a shape, and replays equal the eager forward (the MLP whole).
    This model's pool is too small to show the saving (one 20 MiB segment holds either layout; the
    chunks' requests of 1 MiB or less add a 2 MiB small-pool segment: 24 -> 26 MiB on an H100):
    bench/capture.py measures it on the presets."""
    own = _own_model(checkpoint_dir)
    held, live = {}, {}
    for chunk in (None, 256):
        step = ModelPrefillStep(own.model, own.attention, breakable=backend == "breakable", mlp_chunk_tokens=chunk)
        pool = torch.cuda.graph_pool_handle()
        runner = PrefillGraphRunner(step, create_backend(backend, CUDA, pool=pool),
                                    default_prefill_ladder(CEILING), SLOTS, 2.0, None, torch.bfloat16)
        _settle()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        runner.capture_all(progress=False)
        assert not runner.failed, runner.failed
        held[chunk], live[chunk] = pool_bytes(pool), torch.cuda.max_memory_allocated() - start
        assert runner.resident_bytes == held[chunk]
        _check_replays_equal_eager(own, runner, 3)
        runner.release()
        del runner
    print(f"{backend}: prefill captures with the MLP whole: live peak {live[None] / 2**20:.1f} MiB, pool "
          f"{held[None] / 2**20:.1f} MiB; in chunks of 256 tokens: {live[256] / 2**20:.1f}, "
          f"{held[256] / 2**20:.1f} MiB")
    assert live[256] <= live[None] - (4 << 20)
    assert held[256] <= held[None] + (2 << 20)


def test_a_warm_up_that_leaves_memory_in_the_pool_raises():
    """A forward that creates a buffer on a later shape's first run would have it sit on another
    graph's scratch: the capture refuses with WarmUpLeakError; outside the pool it captures."""
    x = torch.randn(1024, 1024, device=CUDA)
    out = torch.empty_like(x)
    kept: list[torch.Tensor] = []

    def plain() -> None:
        out.copy_(x @ x)

    def lazy() -> None:
        if not kept:
            kept.append(torch.zeros(4 << 20, device=CUDA))  # made on its first run, kept for good
        out.copy_(x @ x + kept[0][:1])

    backend = create_backend("full", CUDA, pool=torch.cuda.graph_pool_handle())
    backend.capture(1, plain, phase="decode")
    with pytest.raises(WarmUpLeakError, match=r"decode shape 2 \(full backend\) left \d+ bytes"):
        backend.capture(2, lazy, phase="decode")
    assert not backend.has(2)
    backend.release()
    kept.clear()
    outside = create_backend("full", CUDA, pool=torch.cuda.graph_pool_handle(), warm_up_in_pool=False)
    outside.capture(1, plain, phase="decode")
    outside.capture(2, lazy, phase="decode")
    outside.replay(2)
    torch.testing.assert_close(out, x @ x)
    outside.release()


def test_kv_pages_with_graphs_cost_at_most_the_graph_memory_and_capture_fits(checkpoint_dir):
    """At cache.gpu_memory_fraction=1.0 the KV cache takes every byte but the headroom; graphs then
    capture (prefill up to the chunk, decode to 256) without running out of memory, and cost at
    most their measured bytes in KV pages (no hidden reserve)."""
    path = checkpoint_dir("tiny-llama")
    common = [f"model.path={path}", "cache.gpu_memory_fraction=1.0", "scheduler.chunked_prefill_size=8192",
              "scheduler.max_num_batched_tokens=8192"]
    start = _settle()
    off = Engine(load_config(None, common + ["graphs.enabled=false"]))
    pages_off = off.worker.num_pages
    shape = off.worker.kv_cache.shape
    off.shutdown()
    del off
    assert _settle() <= start + 64 * 2**20, "the graphs-off engine's memory was not given back"
    on = Engine(load_config(None, common))
    runner = on.worker.runner
    assert not runner.prefill_runner.failed and not runner.decode_runner.failed
    assert runner.prefill_runner.ladder[-1] == 8192
    graph_bytes = runner.prefill_runner.resident_bytes + runner.decode_runner.resident_bytes
    pages_on = on.worker.num_pages
    per_page = KVCacheShape(shape.num_layers, 1, shape.page_size, shape.num_kv_heads,
                            shape.head_dim).bytes_per_page(torch.bfloat16)
    pool = pool_bytes(graph_pool(CUDA))  # the runners count their growth; earlier tests may have left free blocks
    print(f"KV pages: graphs off {pages_off}, on {pages_on}; graph memory {graph_bytes / 2**20:.1f} MiB "
          f"({graph_bytes // per_page} pages' worth), the process pool {pool / 2**20:.1f} MiB")
    assert (pages_off - pages_on) * per_page <= graph_bytes
    from worker.sampling.params import SamplingParams
    got = on.generate([[5] * 300, [7] * 40], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in got] == [8, 8]
    on.shutdown()
