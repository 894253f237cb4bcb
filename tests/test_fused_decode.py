"""The fused decode attention kernel (worker/attention/fused_decode.py): RoPE, the KV write and
paged attention with the KV split merged in one launch.

On CPU the kernel runs in Triton's interpreter against a plain PyTorch reference in float32: page
boundaries (a row whose cached tokens end exactly on a page, one past it), a padding row on the
dummy page, grouped-query heads that are not a power of two, rows longer than several splits, every
split count from one to the maximum, and a second launch after the first (the done-counters are
back at zero). The GPU test compares it with flashinfer's path in the backend, eager and in graphs.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import rope_reference
from worker.model.rotary import cos_sin_cache

pytest.importorskip("triton", reason="the fused decode attention kernel is written in Triton")
from worker.attention.fused_decode import (  # noqa: E402
    MAX_SPLITS,
    FusedDecodeAttention,
    decode_splits,
    supports,
)

PAGE = 4
DUMMY = 0


def _case(seq_lens, q_heads, kv_heads, head_dim, seed=0):
    """Rows of ``seq_lens`` tokens (this step's included; 1 with no pages is a padding row on the
    dummy page) on shuffled pages of a random float32 cache, as the backend's metadata lays them out."""
    g = torch.Generator().manual_seed(seed)
    rows = len(seq_lens)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    need = sum(-(-n // PAGE) for n in seq_lens)
    free = (torch.randperm(need + 3, generator=g) + 1).tolist()  # page 0 is the dummy page
    cache = torch.randn(need + 4, 2, PAGE, kv_heads, head_dim, generator=g)
    indptr, indices, last, locations, tables = [0], [], [], [], []
    for n in seq_lens:
        table = [DUMMY] if n == 0 else [free.pop() for _ in range(-(-n // PAGE))]
        n = max(n, 1)
        tables.append((table, n))
        indices += table
        indptr.append(len(indices))
        last.append((n - 1) % PAGE + 1)
        locations.append(table[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE)
    positions = torch.randint(0, 60, (rows,), generator=g)
    i32 = dict(dtype=torch.int32)
    meta = (torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32))
    table = cos_sin_cache(head_dim, 10000.0, None, 64, torch.device("cpu"))
    return q, k, v, positions, torch.tensor(locations, **i32), cache, meta, table, tables


def _expected(q, k, v, positions, locations, cache, table, tables, q_heads, kv_heads, head_dim, scale):
    """(attention output, the cache after this step's writes), float32, computed the unfused way:
    rotate, store, then attend over every token of the row from the cache."""
    cache = cache.clone()
    k_rot = rope_reference(k, positions, table, kv_heads, head_dim)
    q_rot = rope_reference(q, positions, table, q_heads, head_dim)
    v3 = v.view(v.shape[0], kv_heads, head_dim)
    for r, loc in enumerate(locations.tolist()):
        cache[loc // PAGE, 0, loc % PAGE] = k_rot[r]
        cache[loc // PAGE, 1, loc % PAGE] = v3[r]
    out = torch.empty(q.shape[0], q_heads, head_dim)
    group = q_heads // kv_heads
    for r, (pages, n) in enumerate(tables):
        kv = cache[pages].permute(1, 0, 2, 3, 4).reshape(2, -1, kv_heads, head_dim)[:, :n]  # (2, n, Hk, D)
        keys, values = kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q_rot[r], keys) * scale, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", weights, values)
    return out, cache


@pytest.mark.parametrize("splits", [1, 3, MAX_SPLITS])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(6, 2, 32), (8, 1, 64), (4, 4, 32)])
def test_matches_rope_store_then_attention_in_float32(q_heads, kv_heads, head_dim, splits):
    # 0: a padding row; 4 and 5: the cached tokens end on a page boundary and one past it; 1: no
    # cached token; 70 and 97: longer than several tiles of every split count.
    seq_lens = [5, 0, 70, 4, 1, 97]
    q, k, v, pos, loc, cache, (indptr, indices, last), table, tables = _case(seq_lens, q_heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected_out, expected_cache = _expected(q, k, v, pos, loc, cache, table, tables, q_heads, kv_heads, head_dim,
                                             scale)
    num_sms = splits * len(seq_lens) * kv_heads  # programs of one split cover the SMs `splits` times
    fused = FusedDecodeAttention(q_heads, kv_heads, head_dim, max_rows=8, num_sms=num_sms, device=torch.device("cpu"))
    assert fused.splits(len(seq_lens)) == splits
    q_before, k_before = q.clone(), k.clone()
    for launch in range(2):  # the second launch finds the counters at zero again
        out = fused.launch(q, k, v, pos, table, cache, loc, indptr, indices, last, scale)
        assert out.shape == (len(seq_lens), q_heads, head_dim)
        torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5, msg=f"launch {launch}")
        torch.testing.assert_close(cache, expected_cache, rtol=0, atol=1e-6)
        assert int(fused.counters.abs().sum()) == 0
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # q and k are only read


def test_split_counts_cover_the_sms_once_and_stop_at_the_maximum():
    assert decode_splits(1, 4, 132) == MAX_SPLITS
    assert decode_splits(8, 4, 132) == 4
    assert decode_splits(64, 4, 132) == 1 and decode_splits(256, 8, 132) == 1


def test_shapes_it_does_not_serve_are_refused_by_name():
    assert supports(32, 4, 64) and supports(32, 8, 128) and not supports(64, 2, 128) and not supports(8, 2, 24)
    with pytest.raises(ValueError, match="does not serve 64 query heads over 2 KV heads of 128"):
        FusedDecodeAttention(64, 2, 128, max_rows=4, num_sms=8, device=torch.device("cpu"))
    fused = FusedDecodeAttention(4, 4, 32, max_rows=2, num_sms=8, device=torch.device("cpu"))
    q, k, v, pos, loc, cache, (indptr, indices, last), table, _ = _case([3, 2, 5], 4, 4, 32)
    with pytest.raises(ValueError, match="fused decode attention of 3 rows; this backend serves 1 to 2"):
        fused.launch(q, k, v, pos, table, cache, loc, indptr, indices, last, 0.1)


# ---------------------------------------------------------------- in the flashinfer backend (GPU)


def _backend_pair(q_heads, kv_heads, head_dim, rows):
    """Two flashinfer backends over caches of the same random contents: one with the fused decode
    kernel, one with the engine's default path (the fused RoPE + KV write, flashinfer's attention)."""
    from worker.attention.base import AttentionShape
    from worker.attention.flashinfer_backend import FlashInferBackend
    from worker.kv_cache import KVCacheShape, PagedKVCache

    cache = PagedKVCache(KVCacheShape(2, 40 * rows + 2, 16, kv_heads, head_dim), torch.bfloat16, "cuda")
    cache.kv.normal_(generator=torch.Generator(device="cuda").manual_seed(1))
    twin = PagedKVCache(cache.shape, torch.bfloat16, "cuda")
    twin.kv.copy_(cache.kv)
    shape = AttentionShape(q_heads, kv_heads, head_dim, head_dim ** -0.5)
    common = dict(fast_decode_plan=True, fused_rope_store=True, decode_graph_split_kv="auto")
    fused = FlashInferBackend(shape, cache, rows, rows, 40, fused_decode=True, **common)
    plain = FlashInferBackend(shape, twin, rows, rows, 40, **common)
    assert fused.fused_decode and not plain.fused_decode
    return fused, plain


def _decode_batch(seed, rows, page=16):
    """Live rows of random lengths (some ending on a page boundary or one past it) on distinct
    shuffled pages, and padding rows on the dummy page up to ``rows``."""
    from worker.attention.base import AttentionBatch

    g = torch.Generator().manual_seed(seed)
    live = max(1, rows - 2)
    lens = [int(x) for x in torch.randint(1, 600, (live,), generator=g)]
    lens[: 3] = [16, 17, 513][: live]
    free = (torch.randperm(40 * rows, generator=g) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-n // page))] for n in lens]
    pad = rows - live
    batch = AttentionBatch.decode(lens + [1] * pad, tables + [[DUMMY]] * pad)
    positions = torch.tensor([n - 1 for n in lens] + [0] * pad, device="cuda")
    return batch, positions, live


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(32, 4, 64), (32, 8, 128)], ids=["tinyllama", "llama-3-8b"])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_the_backends_fused_decode_matches_its_flashinfer_path_eager_and_in_graphs(q_heads, kv_heads, head_dim, rows):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (make test-gpu)")
    pytest.importorskip("flashinfer")
    from worker.attention.base import Rope
    from worker.model.flashinfer_kernels import FlashInferKernels

    fused, plain = _backend_pair(q_heads, kv_heads, head_dim, rows)
    table = cos_sin_cache(head_dim, 10000.0, None, 4096, torch.device("cuda"))
    width = (q_heads + 2 * kv_heads) * head_dim
    static = {b: (torch.zeros(rows, width, dtype=torch.bfloat16, device="cuda"),
                  torch.zeros(rows, dtype=torch.int64, device="cuda")) for b in ("fused", "plain")}
    backends = {"fused": fused, "plain": plain}

    def forward(name):
        qkv, positions = static[name]
        q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        rope = Rope(positions, table, head_dim, FlashInferKernels().apply_rope)
        return backends[name].run_with_rope(1, rope, q, k, v)

    def step(seed, run):
        batch, positions, live = _decode_batch(seed, rows)
        qkv = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).cuda()
        outs = {}
        for name, backend in backends.items():
            backend.plan(batch)
            static[name][0].copy_(qkv)
            static[name][1].copy_(positions)
            outs[name] = run(name)
        torch.cuda.synchronize()
        torch.testing.assert_close(outs["fused"][:live].float(), outs["plain"][:live].float(), rtol=2e-2, atol=2e-2)
        # Every page but the dummy one, where the padding rows' writes race (either may land last).
        torch.testing.assert_close(fused.kv_cache.layer(1)[1:].float(), plain.kv_cache.layer(1)[1:].float(),
                                   rtol=1e-2, atol=1e-2)
        assert int(fused._fused_decode.counters.abs().sum()) == 0

    for seed in range(2):  # eager, before any graph wrapper exists
        step(seed, forward)
    graphs, outputs = {}, {}
    for name, backend in backends.items():
        backend.graph_wrapper(False, rows)
        backend.plan(_decode_batch(99, rows)[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(name)  # warm-up outside the capture (JIT, cached buffers)
        torch.cuda.current_stream().wait_stream(side)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            outputs[name] = forward(name)
    fused.kv_cache.kv.copy_(plain.kv_cache.kv)  # the warm-ups wrote this step's KV of different batches

    def replay(name):
        graphs[name].replay()
        return outputs[name]

    for seed in range(2, 5):  # replays after re-planning other batches of the same shape
        step(seed, replay)
