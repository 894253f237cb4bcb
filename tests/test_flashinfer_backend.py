"""FlashInferBackend against a plain-PyTorch attention reference.

The GPU tests need CUDA and flashinfer; the metadata and import tests run anywhere.
"""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from worker.attention.base import AttentionBatch, AttentionShape, kv_write_locations
from worker.attention.flashinfer_backend import INSTALL_HINT, FlashInferBackend
from worker.attention.flashinfer_metadata import build_metadata, check_kernels
from worker.kv_cache import KVCacheShape, PagedKVCache

PAGE = 16
HQ, HKV, D = 8, 2, 128
LAYERS, NUM_PAGES = 2, 96
LAYER = 1
DTYPE = torch.bfloat16
SHAPE = AttentionShape(HQ, HKV, D, 1.0 / math.sqrt(D))
TOL = dict(rtol=2e-2, atol=2e-2)
DUMMY = PagedKVCache.DUMMY_PAGE


@pytest.fixture
def flashinfer():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip("flashinfer")


# ---------------------------------------------------------------- helpers


def make_cache() -> PagedKVCache:
    cache = PagedKVCache(KVCacheShape(LAYERS, NUM_PAGES, PAGE, HKV, D), DTYPE, "cuda")
    cache.kv.normal_()  # every page, prefixes included, holds random K/V
    return cache


class Pages:
    """Hands out distinct, shuffled pages 1..NUM_PAGES-1 (page 0 is the dummy page)."""

    def __init__(self, seed: int) -> None:
        self.free = list(range(1, NUM_PAGES))
        random.Random(seed).shuffle(self.free)

    def table(self, seq_len: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-seq_len // PAGE))]


def prefill_batch(pages: Pages, seq_lens: list[int], q_lens: list[int], num_tokens: int) -> AttentionBatch:
    return AttentionBatch(True, seq_lens, q_lens, [pages.table(s) for s in seq_lens], num_tokens)


def decode_batch(pages: Pages, seq_lens: list[int], num_rows: int) -> AttentionBatch:
    pad = num_rows - len(seq_lens)
    return AttentionBatch.decode(seq_lens + [1] * pad, [pages.table(s) for s in seq_lens] + [[DUMMY]] * pad)


def qkv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(tokens, h, D, generator=g, device="cuda").to(DTYPE) for h in (HQ, HKV, HKV))


def reference(cache: torch.Tensor, batch: AttentionBatch, q: torch.Tensor) -> torch.Tensor:
    """Per-request causal GQA attention in fp32 over the pages gathered from ``cache`` (one layer)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group, offset = HQ // HKV, 0
    for seq_len, q_len, table in zip(batch.seq_lens, batch.query_lens, batch.page_tables, strict=True):
        if q_len:
            pages = torch.tensor(table[: -(-seq_len // PAGE)], device=q.device)
            k = cache[pages, 0].reshape(-1, HKV, D)[:seq_len].float().repeat_interleave(group, dim=1)
            v = cache[pages, 1].reshape(-1, HKV, D)[:seq_len].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[offset: offset + q_len].float(), k) * SHAPE.scale
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            out[offset: offset + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
        offset += q_len
    return out


def real_rows(batch: AttentionBatch) -> int:
    """Tokens whose output is checked: decode padding rows and prefill tail padding are excluded."""
    if batch.is_prefill:
        return sum(batch.query_lens)
    return sum(1 for t in batch.page_tables.tolist() if t != [DUMMY])


def check(backend: FlashInferBackend, batch: AttentionBatch, q, k, v, out: torch.Tensor) -> None:
    torch.cuda.synchronize()
    cache = backend.kv_cache.layer(LAYER)
    n = real_rows(batch)
    locations = torch.tensor(kv_write_locations(batch, PAGE)[:n], device="cuda")
    assert torch.equal(cache[locations // PAGE, 0, locations % PAGE], k[:n]), "K not stored at the planned locations"
    assert torch.equal(cache[locations // PAGE, 1, locations % PAGE], v[:n]), "V not stored at the planned locations"
    assert out.shape == (batch.num_tokens, HQ, D) and out.dtype == DTYPE
    torch.testing.assert_close(out[:n].float(), reference(cache, batch, q)[:n], **TOL)


def capture(backend: FlashInferBackend, q, k, v) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: JIT loads and cached buffers happen outside capture
        backend.run(LAYER, q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.run(LAYER, q, k, v)
    return graph, out


def capture_decode(backend: FlashInferBackend, rows: int) -> tuple:
    """A decode graph of ``rows`` rows captured after a first plan: ``(q, k, v, graph, out)``."""
    backend.graph_wrapper(False, rows)
    q, k, v = (torch.zeros(rows, h, D, dtype=DTYPE, device="cuda") for h in (HQ, HKV, HKV))
    backend.plan(decode_batch(Pages(4), [3, 9], rows))
    return (q, k, v, *capture(backend, q, k, v))


def replay_checked(backend: FlashInferBackend, captured: tuple, seed: int, seq_lens: list[int]) -> AttentionBatch:
    """Re-plan ``captured`` (:func:`capture_decode`) for a new batch, replay it and check it."""
    q, k, v, graph, out = captured
    batch = decode_batch(Pages(seed), seq_lens, q.shape[0])
    backend.plan(batch)
    for dst, src in zip((q, k, v), qkv(q.shape[0], seed), strict=True):
        dst.copy_(src)
    graph.replay()
    check(backend, batch, q, k, v, out)
    return batch


# ---------------------------------------------------------------- CPU tests


def test_metadata_sentinel_rows_are_empty_requests():
    batch = AttentionBatch(True, [33, 0, 16, 5], [13, 0, 16, 5], [[7, 3, 9], [], [2, 8], [4]], 36)
    qo, kv, last, indices, locations = build_metadata(batch, PAGE)
    qo, kv, last, indices = qo.tolist(), kv.tolist(), last.tolist(), indices.tolist()
    assert qo == [0, 13, 13, 29, 34]
    assert kv == [0, 3, 3, 4, 5]
    assert last == [1, 0, 16, 5]
    assert indices == [7, 3, 9, 2, 4]  # only the pages covering seq_len
    assert locations.tolist() == kv_write_locations(batch, PAGE).tolist() and len(locations) == 36
    # flashinfer's kv length: 0 without pages, else (pages - 1) * page_size + last_page_len
    lengths = [0 if kv[i + 1] == kv[i] else (kv[i + 1] - kv[i] - 1) * PAGE + last[i] for i in range(4)]
    assert lengths == batch.seq_lens


def test_metadata_rejects_short_page_table():
    with pytest.raises(ValueError, match="needs 2 pages"):
        build_metadata(AttentionBatch.decode([17], [[5]]), PAGE)


def test_module_imports_without_flashinfer_and_construction_explains(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    cache = PagedKVCache(KVCacheShape(1, 4, PAGE, HKV, D), DTYPE, "cpu")
    with pytest.raises(ImportError, match="graphfleet\\[gpu\\]"):
        FlashInferBackend(SHAPE, cache, 4, 64)
    assert "attention.backend=torch" in INSTALL_HINT


def test_kernel_families_are_checked_before_any_kernel_runs():
    """fa2 everywhere; fa3 only on Hopper and, for decode, only as tensor-core decode; anything else
    names the setting."""
    check_kernels("fa2", "fa2", False, (8, 0))
    check_kernels("fa3", "fa3", True, (9, 0))
    with pytest.raises(ValueError, match=r"attention\.prefill_kernel='fa4'; allowed: fa2, fa3"):
        check_kernels("fa4", "fa2", True, (9, 0))
    with pytest.raises(ValueError, match=r"decode_kernel=fa3 needs a Hopper GPU \(sm_90\); this one is sm_80"):
        check_kernels("fa2", "fa3", True, (8, 0))
    with pytest.raises(ValueError, match=r"attention\.prefill_kernel=fa3 needs a Hopper GPU.*sm_100"):
        check_kernels("fa3", "fa2", True, (10, 0))
    with pytest.raises(ValueError, match="only as tensor-core decode"):
        check_kernels("fa2", "fa3", False, (9, 0))


def test_the_config_carries_every_flashinfer_setting_to_the_backend():
    """Each attention setting but ``backend`` is flashinfer's and reaches its constructor by name."""
    import dataclasses
    import inspect

    from configkit import ConfigError
    from worker.attention.factory import FLASHINFER_OPTIONS, flashinfer_options
    from worker.config import AttentionConfig

    fields = {f.name for f in dataclasses.fields(AttentionConfig)} - {"backend"}
    assert set(FLASHINFER_OPTIONS) == fields
    assert fields <= set(inspect.signature(FlashInferBackend).parameters)
    options = flashinfer_options(AttentionConfig(prefill_kernel="fa3", decode_kernel="fa3"))
    assert options["prefill_kernel"] == options["decode_kernel"] == "fa3"
    with pytest.raises(ConfigError, match="decode_kernel"):
        AttentionConfig.from_dict({"decode_kernel": "fa4"})


# ---------------------------------------------------------------- attention (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("tail_padding", [0, 5])
def test_prefill_matches_reference(flashinfer, tail_padding):
    backend = FlashInferBackend(SHAPE, make_cache(), 8, 256)
    before = backend.kv_cache.layer(0).clone()
    # chunked-prefill continuation, fresh request, sentinel, multi-page fresh, one-token continuation
    seq_lens, q_lens = [33, 5, 0, 40, 17], [13, 5, 0, 40, 1]
    batch = prefill_batch(Pages(0), seq_lens, q_lens, sum(q_lens) + tail_padding)
    backend.plan(batch)
    q, k, v = qkv(batch.num_tokens, seed=1)
    out = backend.run(LAYER, q, k, v)
    check(backend, batch, q, k, v, out)
    assert torch.equal(backend.kv_cache.layer(0), before), "another layer's cache was written"


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores", [True, False])
def test_decode_with_padding_rows_matches_reference(flashinfer, tensor_cores):
    backend = FlashInferBackend(SHAPE, make_cache(), 8, 256, decode_use_tensor_cores=tensor_cores)
    batch = decode_batch(Pages(2), [1, 17, 33, 64, 5], num_rows=8)
    backend.plan(batch)
    q, k, v = qkv(8, seed=3)
    check(backend, batch, q, k, v, backend.run(LAYER, q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("split_kv", [True, False])
def test_decode_cuda_graph_replays_after_replanning(flashinfer, split_kv):
    cache = make_cache()
    backend = FlashInferBackend(SHAPE, cache, 8, 256, decode_graph_split_kv=split_kv)
    eager = FlashInferBackend(SHAPE, cache, 8, 256)  # same cache, no graph wrappers
    captured = capture_decode(backend, 8)
    q, k, v, _, out = captured

    # two different batches through the same graph: lengths, pages and padding all change
    for seed, seq_lens in ((5, [1, 17, 33, 64, 80]), (6, [40, 2, 16, 15, 31, 32, 48, 7])):
        batch = replay_checked(backend, captured, seed, seq_lens)
        eager.plan(batch)
        expected = eager.run(LAYER, q, k, v)  # rewrites the same K/V at the same locations
        n = real_rows(batch)
        torch.testing.assert_close(out[:n].float(), expected[:n].float(), **TOL)


@pytest.mark.gpu
def test_every_wrapper_shares_one_int_workspace_and_replays_its_own_plan(flashinfer):
    """Eager and per-shape graph wrappers, prefill and decode, use the backend's one int workspace;
    graphs of two decode shapes, each re-planned before its replay, still compute their own batch."""
    cache = make_cache()
    backend = FlashInferBackend(SHAPE, cache, 8, 256)
    for is_prefill, rows, tokens in ((False, 4, None), (False, 8, None), (True, 2, 64), (True, 4, 128)):
        backend.graph_wrapper(is_prefill, rows, tokens)
    wrappers = [backend._eager_prefill, backend._eager_decode, *backend._graph_wrappers.values()]
    assert {w._int_workspace_buffer.data_ptr() for w in wrappers} == {backend.int_workspace.data_ptr()}
    graphs = {}
    for rows in (4, 8):
        q, k, v = (torch.zeros(rows, h, D, dtype=DTYPE, device="cuda") for h in (HQ, HKV, HKV))
        backend.plan(decode_batch(Pages(rows), [3, 9][: rows // 4], rows))
        graphs[rows] = (q, k, v, *capture(backend, q, k, v))
    for seed, rows, seq_lens in ((21, 8, [5, 700, 33, 64, 80]), (22, 4, [600, 2, 16]), (23, 8, [1, 2])):
        pages = Pages(seed)
        batch = AttentionBatch.decode(seq_lens, [pages.table(n) for n in seq_lens])
        q, k, v, graph, out = graphs[rows]
        backend.plan(batch, rows)
        for dst, src in zip((q, k, v), qkv(rows, seed), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        padded = AttentionBatch.decode(seq_lens + [1] * (rows - len(seq_lens)),
                                       batch.page_tables.tolist() + [[DUMMY]] * (rows - len(seq_lens)))
        torch.testing.assert_close(out[: len(seq_lens)].float(),
                                   reference(cache.layer(LAYER), padded, q)[: len(seq_lens)], **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("split_kv", [True, False, "auto"])
def test_fast_decode_plan_makes_flashinfers_own_plan(flashinfer, split_kv):
    """``fast_decode_plan`` re-plans a captured decode shape through flashinfer's scheduler alone:
    the plan is the one flashinfer's ``plan`` makes (same plan info) and the replay's output equals
    the ordinary plan's bit for bit, over batches whose lengths, pages and padding change, long rows
    (split KV) included."""
    cache = make_cache()
    fast = FlashInferBackend(SHAPE, cache, 8, 256, fast_decode_plan=True, decode_graph_split_kv=split_kv)
    plain = FlashInferBackend(SHAPE, cache, 8, 256, decode_graph_split_kv=split_kv)
    rows = 8
    q, k, v = (torch.zeros(rows, h, D, dtype=DTYPE, device="cuda") for h in (HQ, HKV, HKV))
    graphs = {}
    for backend in (fast, plain):
        backend.graph_wrapper(False, rows)
        backend.plan(decode_batch(Pages(4), [3, 9], rows))
        graphs[id(backend)] = capture(backend, q, k, v)
    assert fast._fast_wrappers and not plain._fast_wrappers, "the first, ordinary plan qualifies the wrapper"
    key = (False, rows, rows)
    for seed, seq_lens in ((5, [1, 17, 33, 64, 80]), (6, [40, 2, 16, 15, 31, 32, 48, 7]), (11, [700, 600]),
                           (12, [1])):
        pages = Pages(seed)
        batch = AttentionBatch.decode(seq_lens, [pages.table(n) for n in seq_lens])
        outs = []
        for backend in (fast, plain):
            backend.plan(batch, rows)
            for dst, src in zip((q, k, v), qkv(rows, seed), strict=True):
                dst.copy_(src)
            graph, out = graphs[id(backend)]
            graph.replay()
            torch.cuda.synchronize()
            outs.append(out[: len(seq_lens)].clone())
        info = list(fast._graph_wrappers[key]._plan_info)
        assert info == list(plain._graph_wrappers[key]._plan_info), seed
        split = int(fast.graph_splits_kv(rows))
        assert info[14] == split, "PrefillPlanInfo's split_kv (its 15th field) follows the setting"
        assert torch.equal(outs[0], outs[1]), f"seed {seed}: the fast plan's replay differs"
        padded = AttentionBatch.decode(seq_lens + [1] * (rows - len(seq_lens)),
                                       batch.page_tables.tolist() + [[DUMMY]] * (rows - len(seq_lens)))
        torch.testing.assert_close(outs[0].float(), reference(cache.layer(LAYER), padded, q)[: len(seq_lens)],
                                   **TOL)


@pytest.mark.gpu
def test_prefill_cuda_graph_replays_with_more_tokens_than_captured(flashinfer):
    cache = make_cache()
    backend = FlashInferBackend(SHAPE, cache, 8, 256)
    eager = FlashInferBackend(SHAPE, cache, 8, 256)
    rows, tokens = 4, 64
    backend.graph_wrapper(True, rows, tokens)
    q, k, v = (torch.zeros(tokens, h, D, dtype=DTYPE, device="cuda") for h in (HQ, HKV, HKV))
    backend.plan(prefill_batch(Pages(7), [20, 8, 0, 0], [12, 8, 0, 0], tokens))
    graph, out = capture(backend, q, k, v)

    cases = ((8, [50, 30, 0, 10], [30, 20, 0, 10]), (9, [64, 0, 0, 0], [64, 0, 0, 0]),
             (10, [3, 90, 0, 0], [3, 2, 0, 0]))
    for seed, seq_lens, q_lens in cases:
        batch = prefill_batch(Pages(seed), seq_lens, q_lens, tokens)
        backend.plan(batch)
        for dst, src in zip((q, k, v), qkv(tokens, seed), strict=True):
            dst.copy_(src)
        graph.replay()
        check(backend, batch, q, k, v, out)
        eager.plan(batch)
        expected = eager.run(LAYER, q, k, v)
        n = real_rows(batch)
        torch.testing.assert_close(out[:n].float(), expected[:n].float(), **TOL)


@pytest.mark.gpu
def test_fa3_kernels_match_the_reference_eager_and_in_graphs(flashinfer):
    """``prefill_kernel`` / ``decode_kernel`` fa3 (Hopper): prefill with a sentinel and tail padding,
    eager decode with padding rows, and a captured decode shape re-planned for two batches."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 kernels need a Hopper GPU")
    cache = make_cache()
    backend = FlashInferBackend(SHAPE, cache, 8, 256, prefill_kernel="fa3", decode_kernel="fa3",
                                fast_decode_plan=True)
    batch = prefill_batch(Pages(0), [33, 5, 0, 40, 17], [13, 5, 0, 40, 1], 64)
    backend.plan(batch)
    q, k, v = qkv(batch.num_tokens, seed=1)
    check(backend, batch, q, k, v, backend.run(LAYER, q, k, v))
    batch = decode_batch(Pages(2), [1, 17, 33, 64, 5], num_rows=8)
    backend.plan(batch)
    q, k, v = qkv(8, seed=3)
    check(backend, batch, q, k, v, backend.run(LAYER, q, k, v))

    captured = capture_decode(backend, 8)
    assert not backend._fast_wrappers, "the fast plan reproduces fa2's plan only"
    for seed, seq_lens in ((5, [1, 17, 33, 64, 80]), (6, [40, 2, 16, 15, 31, 32, 48, 7])):
        replay_checked(backend, captured, seed, seq_lens)


@pytest.mark.gpu
def test_plan_rejects_oversized_batches(flashinfer):
    backend = FlashInferBackend(SHAPE, make_cache(), 2, 8)
    with pytest.raises(ValueError, match="exceeds"):
        backend.plan(AttentionBatch.decode([1, 1, 1], [[DUMMY]] * 3))
    with pytest.raises(ValueError, match="query_len=1"):
        backend.plan(AttentionBatch(False, [4], [2], [[1]], 2))
