"""The add + RMSNorm + qkv + RoPE + KV-write kernel (worker/model/norm_qkv_rope.py) against the two
kernels it folds together, :mod:`worker.model.norm_linear` then :mod:`worker.attention.rope_store`
(Triton's interpreter on CPU; the compiled kernel on a GPU)."""

from __future__ import annotations

import pytest
import torch

from worker.attention.rope_store import rope_and_store
from worker.model.norm_linear import MAX_ROWS, add_rms_norm_linear
from worker.model.norm_qkv_rope import launch, supports
from worker.model.rotary import cos_sin_cache


def _case(rows, q_heads, kv_heads, head_dim, dtype, residual=True, bias=False, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = 96
    out = (q_heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    r = torch.randn(rows, hidden, generator=g).to(dtype) if residual else None
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    w = (torch.randn(out, hidden, generator=g) / hidden ** 0.5).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    positions = torch.randint(0, 500, (rows,), generator=g)
    pages, page_size = 6, 4
    locations = torch.randperm(pages * page_size, generator=g)[:rows]
    cache = torch.randn(pages, 2, page_size, kv_heads, head_dim, generator=g).to(dtype)
    table = cos_sin_cache(head_dim, 10000.0, None, 512, torch.device("cpu"))
    return [t if t is None else t.to(device) for t in (x, r, norm_w, w, b, positions, locations, cache, table)]


def _unfused(x, r, norm_w, w, b, positions, locations, cache, table, q_heads, kv_heads, head_dim):
    """norm_linear's qkv, then rope_store: rotated q and the cache they leave."""
    qkv, new_residual = add_rms_norm_linear(x, r, norm_w, 1e-5, w, b)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    cache = cache.clone()
    rope_and_store(q, k, v, positions, table, cache, locations)
    return q, new_residual, cache


@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(4, 2, 32), (6, 1, 64), (2, 2, 32)])
@pytest.mark.parametrize("residual, bias", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("rows", [1, 5])
def test_equals_norm_linear_then_rope_store_in_float32(q_heads, kv_heads, head_dim, residual, bias, rows):
    x, r, norm_w, w, b, positions, locations, cache, table = _case(rows, q_heads, kv_heads, head_dim, torch.float32,
                                                                   residual, bias)
    want_q, want_residual, want_cache = _unfused(x, r, norm_w, w, b, positions, locations, cache, table, q_heads,
                                                 kv_heads, head_dim)
    got_cache = cache.clone()
    q, new_residual = launch(x, r, norm_w, 1e-5, w, b, q_heads, positions, table, got_cache, locations)
    assert q.shape == (rows, q_heads * head_dim)
    assert torch.allclose(q, want_q, rtol=1e-5, atol=1e-5)
    assert torch.equal(new_residual, want_residual) if r is not None else new_residual is x
    assert torch.allclose(got_cache, want_cache, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(cache.shape[0] * cache.shape[2], dtype=torch.bool)
    untouched[locations] = False
    flat = lambda c: c.permute(0, 2, 1, 3, 4).reshape(-1, *c.shape[1:2], *c.shape[3:])  # noqa: E731
    assert torch.equal(flat(got_cache)[untouched], flat(cache)[untouched])  # only the rows' slots written


def test_both_pair_blocks_agree():
    case = _case(3, 4, 2, 64, torch.float32)
    x, r, norm_w, w, b, positions, locations, cache, table = case
    results = []
    for block_p in (16, 32):
        c = cache.clone()
        q, _ = launch(x, r, norm_w, 1e-5, w, b, 4, positions, table, c, locations, block_p=block_p)
        results.append((q, c))
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)


def test_which_shapes_the_kernel_takes():
    assert supports(64, 32, 4, False) and supports(128, 32, 8, False) and supports(32, 4, 2, False)
    assert not supports(128, 32, 8, True)  # Qwen3: q/k norms before RoPE
    assert not supports(16, 4, 2, False)  # half of 8: below a tl.dot operand
    assert not supports(96, 4, 2, False)  # half of 48: not a power of two


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(32, 4, 64), (32, 8, 128)])
def test_gpu_kernel_equals_the_two_kernels(q_heads, kv_heads, head_dim):
    for rows in (1, 7, MAX_ROWS):
        case = _case(rows, q_heads, kv_heads, head_dim, torch.bfloat16, device="cuda")
        x, r, norm_w, w, b, positions, locations, cache, table = case
        want_q, want_residual, want_cache = _unfused(*case, q_heads, kv_heads, head_dim)
        got_cache = cache.clone()
        q, new_residual = launch(x, r, norm_w, 1e-5, w, b, q_heads, positions, table, got_cache, locations)
        # Different tilings sum the projection in another order: the same bf16 values but for rare
        # one-ulp roundings, which RoPE then mixes.
        assert ((q.float() - want_q.float()).abs() <= want_q.float().abs().clamp_min(2 ** -4) * 2 ** -6).all()
        assert ((got_cache.float() - want_cache.float()).abs()
                <= want_cache.float().abs().clamp_min(2 ** -4) * 2 ** -6).all()
        assert torch.equal(new_residual, want_residual)
