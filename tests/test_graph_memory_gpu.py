"""Graph memory on the GPU: warm-ups inside the graph pool, the leak check, KV pages with graphs on."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from deploy.config import load_config
from graphs.backends import WarmUpLeakError, create_backend
from graphs.layout import GRANULE, one_block_bytes, recorded_allocations, replay
from graphs.prefill import PrefillGraphRunner, default_prefill_ladder
from graphs.process import after_free_block, capture_stream, graph_pool, pool_bytes
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


def _prefill_step(checkpoint_dir, backend: str) -> tuple[OwnModel, ModelPrefillStep]:
    if not flashinfer_importable():
        pytest.skip("flashinfer not installed")
    own = OwnModel(checkpoint_dir("tiny-llama"), dtype=torch.bfloat16, device="cuda", backend="flashinfer",
                   num_pages=4096, kernels=select_kernels(CUDA), max_rows=64, max_pages_per_row=512)
    fill_cache_randomly(own)
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


def _fragmenting_body(kept: list[torch.Tensor]):
    """Four 12 MiB scratch buffers, the first and third freed, then a 24 MiB request that neither
    12 MiB hole fits, and an 8 MiB output kept: a live peak of 56 MiB that one block holds only at 72."""
    def body() -> None:
        a, b, c, d = (torch.empty(12 << 20, dtype=torch.uint8, device=CUDA) for _ in range(4))
        del a, c
        wide = torch.empty(24 << 20, dtype=torch.uint8, device=CUDA)
        kept.append(torch.ones(8 << 20, dtype=torch.uint8, device=CUDA))
        del b, d, wide
    return body


def _capture_after_block(body, nbytes: int) -> list[int]:
    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=capture_stream(CUDA)):
        after_free_block(body, nbytes, CUDA)()
    segments = [n for n in _pool_segments(pool) if n > 2 << 20]  # the small pool's 2 MiB ones aside
    graph.reset()
    return segments


def test_the_layouts_block_holds_a_real_capture_and_one_granule_less_does_not():
    """graphs.layout against the caching allocator itself: a recorded run of a body sizes the block
    (72 MiB, above the 56 MiB live peak), a capture after a block of that size lays out in it alone,
    and a capture after a block one granule shorter grows the pool by a segment beside it."""
    kept: list[torch.Tensor] = []
    body = _fragmenting_body(kept)
    with recorded_allocations(CUDA, capture_stream(CUDA)) as events, torch.cuda.stream(capture_stream(CUDA)):
        body()
    nbytes = one_block_bytes(events())
    assert nbytes == 72 << 20 and replay(events(), nbytes - GRANULE) is None
    exact, short = _capture_after_block(body, nbytes), _capture_after_block(body, nbytes - GRANULE)
    print(f"pool segments: after a block of {nbytes >> 20} MiB {[n >> 20 for n in exact]} MiB; "
          f"after one of {(nbytes - GRANULE) >> 20} MiB {[n >> 20 for n in short]} MiB")
    assert exact == [nbytes]
    assert len(short) == 2 and short[0] == nbytes - GRANULE


def _pool_segments(pool: tuple) -> list[int]:
    return sorted((s["total_size"] for s in torch.cuda.memory_snapshot()
                   if tuple(s.get("segment_pool_id", ())) == tuple(pool)), reverse=True)


def test_a_block_freed_inside_a_capture_serves_the_captures_later_requests():
    """The presized layout's premise: the block after_free_block gives a fresh pool inside a capture
    holds what the capture allocates after it (a large request, a mid-sized one that alone would get
    a 20 MiB segment, and a kept output), so the pool is that one segment."""
    pool = torch.cuda.graph_pool_handle()
    x = torch.randn(1 << 20, device=CUDA)
    kept: list[torch.Tensor] = []

    def body() -> None:
        scratch = [torch.empty(40 << 20, dtype=torch.uint8, device=CUDA),
                   torch.empty(4 << 20, dtype=torch.uint8, device=CUDA)]
        kept.append(x * 2)  # 4 MiB: no request here is small enough for the small-block pool
        del scratch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=capture_stream(CUDA)):
        after_free_block(body, 64 << 20, CUDA)()
    segments = _pool_segments(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kept[0], x * 2)
    graph.reset()
    print(f"pool segments after a 64 MiB block: {[n >> 20 for n in segments]} MiB")
    # Requests of 1 MiB or less (the capture's own generator state, say) go to 2 MiB segments of the
    # small-block pool, which a large block never serves; every large request lands in the block.
    assert [n for n in segments if n > 2 << 20] == [64 << 20]


def test_a_presized_first_capture_holds_in_its_block_what_only_the_capture_keeps():
    """The block is sized from a trial capture, not from an eager run: a forward that keeps a 24 MiB
    tensor only while capturing (eager warm-ups keep nothing) still lays out in the one block, and
    the trial's own pool is given back."""
    kept: list[torch.Tensor] = []
    fragmenting = _fragmenting_body(kept)

    def body() -> None:
        fragmenting()
        if torch.cuda.is_current_stream_capturing():
            kept.append(torch.empty(24 << 20, dtype=torch.uint8, device=CUDA))

    pool = torch.cuda.graph_pool_handle()
    backend = create_backend("full", CUDA, pool=pool, presize_pool=True)
    reserved = _settle()
    shape = backend.capture(1, body, phase="test")
    segments = [n for n in _pool_segments(pool) if n > 2 << 20]
    print(f"presized pool after a capture that keeps 24 MiB more than its warm-ups: {[n >> 20 for n in segments]} MiB")
    assert len(segments) == 1 and shape.resident_bytes >= segments[0]
    kept.clear()
    backend.release()
    assert _settle() <= reserved  # nothing of the trial capture, nor of the real one, is left


@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_a_presized_pool_holds_no_more_than_a_grown_one_and_replays_equal_eager(backend, checkpoint_dir):
    """graphs.pool_layout side by side on one model, each in a fresh pool (no graph holds it before the
    first capture: the block must be given inside that capture): the presized pool starts with one
    segment that a trial capture's requests, laid out by graphs.layout, fill; it holds at most what the
    grown pool holds, every byte counts to a shape, and replays equal eager."""
    own, step = _prefill_step(checkpoint_dir, backend)
    held, segments = {}, {}
    for presize in (False, True):
        pool = torch.cuda.graph_pool_handle()
        runner = PrefillGraphRunner(step, create_backend(backend, CUDA, pool=pool, presize_pool=presize),
                                    default_prefill_ladder(CEILING), SLOTS, 2.0, None, torch.bfloat16)
        _settle()
        runner.capture_all(progress=False)
        assert not runner.failed, runner.failed
        held[presize], segments[presize] = pool_bytes(pool), _pool_segments(pool)
        assert runner.resident_bytes == held[presize]
        if presize:
            _check_replays_equal_eager(own, runner, 2)
        runner.release()
        del runner
    print(f"{backend}: grown pool {held[False] / 2**20:.1f} MiB in segments {[n >> 20 for n in segments[False]]} MiB; "
          f"presized {held[True] / 2**20:.1f} MiB in {[n >> 20 for n in segments[True]]} MiB")
    assert held[True] <= held[False]


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
