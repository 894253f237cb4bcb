"""The fused RoPE + KV-write kernel (worker/attention/rope_store.py).

On CPU the kernel runs in Triton's interpreter: the indexing (strided q/k/v views of a fused QKV
output, grouped-query heads that are not a power of two, page boundaries, padding tokens on the
dummy page, int32 and int64 indices) is checked exactly in float32 against a plain PyTorch
reference. On the GPU the compiled kernel is checked against what it replaces, flashinfer's RoPE
then its KV append, and whole models with the fused path on and off are compared.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import rope_reference
from worker.model.rotary import cos_sin_cache

pytest.importorskip("triton", reason="the fused RoPE + KV-write kernel is written in Triton")
from worker.attention.rope_store import rope_and_store, supports  # noqa: E402

PAGE = 4


def _case(tokens, q_heads, kv_heads, head_dim, dtype, device, index_dtype=torch.int64, seed=0, pages=None):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 60, (tokens,), generator=g).to(index_dtype).to(device)
    pages = pages or 3 + tokens // PAGE + 1
    # Tokens on consecutive slots across page boundaries (from offset 2 of page 2), the last two
    # as padding on the dummy page (slot 0), as a padded batch writes them.
    locations = torch.arange(2 * PAGE + 2, 2 * PAGE + 2 + tokens)
    locations[-2:] = 0
    cache = torch.randn(pages, 2, PAGE, kv_heads, head_dim, generator=g).to(dtype).to(device)
    table = cos_sin_cache(head_dim, 10000.0, None, 64, torch.device(device))
    return qkv, q, k, v, positions, locations.to(index_dtype).to(device), cache, table


def _expected(q, k, v, positions, locations, cache, table, q_heads, kv_heads, head_dim):
    """(rotated q, the cache after the writes) in float32; the last writer of a slot wins."""
    out = cache.float().clone()
    k_rot = rope_reference(k, positions, table, kv_heads, head_dim)
    v3 = v.float().view(v.shape[0], kv_heads, head_dim)
    for t, loc in enumerate(locations.long().tolist()):
        out[loc // PAGE, 0, loc % PAGE] = k_rot[t]
        out[loc // PAGE, 1, loc % PAGE] = v3[t]
    return rope_reference(q, positions, table, q_heads, head_dim), out


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(6, 2, 64), (4, 4, 128), (8, 1, 32)])
def test_float32_exact_in_the_interpreter(q_heads, kv_heads, head_dim, index_dtype):
    tokens = 9
    qkv, q, k, v, pos, loc, cache, table = _case(tokens, q_heads, kv_heads, head_dim, torch.float32, "cpu",
                                                 index_dtype)
    before = qkv.clone()
    want_q, want_cache = _expected(q, k, v, pos, loc, cache, table, q_heads, kv_heads, head_dim)
    got = rope_and_store(q, k, v, pos, table, cache, loc)
    assert got.data_ptr() == q.data_ptr()
    torch.testing.assert_close(q.view(tokens, q_heads, head_dim), want_q, rtol=0, atol=1e-6)
    # Every slot but the dummy page's (two padding tokens race there; nothing reads it) holds
    # what was written, or what it held: a write that strayed would show on pages 1 and up.
    torch.testing.assert_close(cache[1:], want_cache[1:], rtol=0, atol=1e-6)
    assert torch.equal(qkv[:, q_heads * head_dim:], before[:, q_heads * head_dim:])  # k and v only read


def test_bfloat16_rounds_once_from_float32():
    q_heads, kv_heads, d = 6, 2, 64
    qkv, q, k, v, pos, loc, cache, table = _case(7, q_heads, kv_heads, d, torch.bfloat16, "cpu")
    want_q, want_cache = _expected(q, k, v, pos, loc, cache, table, q_heads, kv_heads, d)
    rope_and_store(q, k, v, pos, table, cache, loc)
    # one bf16 rounding of the float32 result: within half an ulp (2**-8 relative), plus the
    # interpreter's own float32 -> bfloat16 conversion, which may round the other way
    ulp = want_q.abs().clamp_min(2**-6) * 2**-7
    assert ((q.view_as(want_q).float() - want_q).abs() <= ulp).all()
    live = loc[:-2].long()
    got_k = cache[live // PAGE, 0, live % PAGE].float()
    want_k = want_cache[live // PAGE, 0, live % PAGE]
    assert ((got_k - want_k).abs() <= want_k.abs().clamp_min(2**-6) * 2**-7).all()
    assert torch.equal(cache[live // PAGE, 1, live % PAGE], v[:-2].reshape(-1, kv_heads, d))


def test_bad_inputs_are_refused_by_name():
    _, q, k, v, pos, loc, cache, table = _case(4, 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not fit 2 KV heads of 64"):
        rope_and_store(q, k[:, :64], v, pos, table, cache, loc)
    with pytest.raises(ValueError, match="float32"):
        rope_and_store(q, k, v, pos, table.double(), cache, loc)
    with pytest.raises(ValueError, match="as many positions"):
        rope_and_store(q, k, v, pos[:2], table, cache, loc)
    with pytest.raises(ValueError, match="head_dim / 2 a power of two"):
        rope_and_store(q, k, v, pos, table, cache.view(cache.shape[0], 2, PAGE, 4, 32)[..., :24], loc)
    assert supports(64) and supports(128) and supports(256) and not supports(96) and not supports(80)


CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(32, 4, 64), (32, 8, 128), (5, 1, 128)])
def test_gpu_kernel_equals_flashinfers_rope_then_append(q_heads, kv_heads, head_dim):
    """Against what it replaces: flashinfer's RoPE in place on q and k, then its paged append
    (the backend's unfused path), on bf16 views of one fused QKV output."""
    flashinfer = pytest.importorskip("flashinfer")
    from worker.model.flashinfer_kernels import FlashInferKernels

    tokens = 37
    qkv, q, k, v, pos, loc, cache, table = _case(tokens, q_heads, kv_heads, head_dim, torch.bfloat16, "cuda",
                                                 torch.int32)
    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    rq, rk, rv = ref_qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    FlashInferKernels().apply_rope(pos, rq, rk, head_dim, table)
    pages = torch.arange(cache.shape[0], dtype=torch.int32, device=CUDA)
    flashinfer.page.append_paged_kv_cache(
        rk.reshape(tokens, kv_heads, head_dim), rv.reshape(tokens, kv_heads, head_dim),
        torch.zeros(tokens, dtype=torch.int32, device=CUDA), loc, ref_cache, pages,
        torch.tensor([0, cache.shape[0]], dtype=torch.int32, device=CUDA),
        torch.tensor([PAGE], dtype=torch.int32, device=CUDA), "NHD")
    rope_and_store(q, k, v, pos, table, cache, loc)
    torch.cuda.synchronize()
    # float32 math in both, rounded once: at most one bf16 ulp apart, and rarely that
    for got, want in ((q, rq), (cache[1:, 0], ref_cache[1:, 0])):
        diff = (got.float() - want.float()).abs()
        assert (diff <= want.float().abs().clamp_min(2**-6) * 2**-7).all()
        assert (diff > 0).float().mean() < 0.01
    assert torch.equal(cache[1:, 1], ref_cache[1:, 1])
    assert torch.equal(v, rv)  # v is only read (flashinfer's RoPE rotated the reference's k in place)


@pytest.mark.gpu
def test_gpu_kernel_is_captured_in_a_graph_and_reads_new_locations():
    _, q, k, v, pos, loc, cache, table = _case(8, 8, 2, 64, torch.bfloat16, "cuda", torch.int32, pages=12)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    static_loc = loc.clone()
    rope_and_store(q, k, v, pos, table, cache, static_loc)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_and_store(q, k, v, pos, table, cache, static_loc)
    q.copy_(q0)
    static_loc.copy_(torch.arange(40, 48, dtype=torch.int32, device=CUDA))
    graph.replay()
    torch.cuda.synchronize()
    want_q, want_cache = _expected(q0, k0, v0, pos, static_loc, cache, table, 8, 2, 64)
    assert ((q.view_as(want_q).float() - want_q).abs() <= want_q.abs().clamp_min(2**-6) * 2**-7).all()
    got = cache[10:12].float()
    assert ((got - want_cache[10:12]).abs() <= want_cache[10:12].abs().clamp_min(2**-6) * 2**-7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_gpu_model_with_the_fused_kernel_equals_the_two_kernel_path(preset, checkpoint_dir):
    """A whole bf16 model on flashinfer, fused_rope_store on and off: a prefill of three prompts
    (page boundaries inside them) and 12 decode steps give the same greedy tokens and logits
    within bf16 noise."""
    pytest.importorskip("flashinfer")
    from tests.reference import OwnModel, prefill_then_greedy, rel_l2
    from worker.model.kernels import select_kernels

    path = checkpoint_dir(preset)
    prompts = [list(range(3, 3 + n)) for n in (5, 37, 64)]
    runs = {}
    for fused in (False, True):
        own = OwnModel(path, dtype=torch.bfloat16, device="cuda", backend="flashinfer",
                       kernels=select_kernels(CUDA), fused_rope_store=fused)
        assert own.attention.fused_rope_store == fused
        logits, tokens = prefill_then_greedy(own, prompts, 12)
        runs[fused] = (torch.cat(logits), tokens)
    assert runs[True][1] == runs[False][1]
    err = rel_l2(runs[True][0], runs[False][0])
    print(f"{preset}: fused RoPE + KV write vs two kernels: logits rel L2 {err:.2e}")
    assert err <= 1e-2
