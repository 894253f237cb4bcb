"""The flashinfer element-wise kernels the model uses (RMSNorm, fused add + RMSNorm, SiLU-and-mul,
NeoX RoPE on fused-QKV views) against plain-PyTorch references (GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

D = 128
DTYPE = torch.bfloat16
TOL = dict(rtol=2e-2, atol=2e-2)


@pytest.fixture
def fk():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("flashinfer")
    from worker.model.flashinfer_kernels import FlashInferKernels

    assert FlashInferKernels.available()
    return FlashInferKernels()


def rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(7, 1024), (2, 5, 1024)])
def test_rms_norm(fk, shape):
    x = torch.randn(shape, device="cuda").to(DTYPE)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(DTYPE)
    out = fk.rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == DTYPE
    torch.testing.assert_close(out.float(), rms_ref(x, w, 1e-5), **TOL)


@pytest.mark.gpu
def test_fused_add_rms_norm_is_in_place(fk):
    x = torch.randn(9, 1024, device="cuda").to(DTYPE)
    res = torch.randn(9, 1024, device="cuda").to(DTYPE)
    w = (1 + 0.1 * torch.randn(1024, device="cuda")).to(DTYPE)
    total = x.float() + res.float()
    expected = rms_ref(total, w, 1e-6)
    normed, new_res = fk.fused_add_rms_norm(x, res, w, 1e-6)
    assert normed.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    torch.testing.assert_close(new_res.float(), total, **TOL)
    torch.testing.assert_close(normed.float(), expected, **TOL)


@pytest.mark.gpu
def test_silu_and_mul(fk):
    x = torch.randn(3, 5, 2 * 704, device="cuda").to(DTYPE)
    out = fk.silu_and_mul(x)
    assert out.shape == (3, 5, 704)
    torch.testing.assert_close(out.float(), F.silu(x[..., :704].float()) * x[..., 704:].float(), **TOL)


def neox_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x = x.float().view(x.shape[0], -1, D)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(1)


@pytest.mark.gpu
def test_apply_rope_neox_in_place_on_fused_qkv_views(fk):
    tokens, hq, hk, max_pos = 11, 4, 2, 512
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.arange(max_pos, device="cuda").float()[:, None] * inv_freq[None, :]
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), device="cuda")
    fused = torch.randn(tokens, (hq + 2 * hk) * D, device="cuda").to(DTYPE)
    original = fused.clone()
    q, k = fused[:, : hq * D], fused[:, hq * D: (hq + hk) * D]
    cos, sin = freqs[positions].cos(), freqs[positions].sin()
    q_ref, k_ref = neox_rope_ref(q, cos, sin), neox_rope_ref(k, cos, sin)

    q_out, k_out = fk.apply_rope(positions, q, k, D, cos_sin_cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q_out.float(), q_ref, **TOL)
    torch.testing.assert_close(k_out.float(), k_ref, **TOL)
    assert torch.equal(fused[:, (hq + hk) * D:], original[:, (hq + hk) * D:]), "v slice was modified"
