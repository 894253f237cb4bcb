"""Element-wise building blocks with a pure-PyTorch implementation and a fused GPU one.

``TorchKernels`` reproduces HF transformers' arithmetic order exactly (so fp32 logits match to
rounding); ``select_kernels`` picks flashinfer's fused kernels on CUDA when they are available.
The layers call only the ``Kernels`` interface, so the same layer code runs on CPU and GPU.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class TorchKernels:
    """Reference kernels in plain PyTorch (any device)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    @classmethod
    def fused_add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return cls.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = cos_sin_cache[positions]  # (tokens, head_dim) float32
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(q.dtype)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(q.dtype)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x = x.view(x.shape[0], -1, head_dim)
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
            return (x * cos + rotated * sin).flatten(1)

        return rotate(q), rotate(k)


def select_kernels(device: torch.device, prefer_fused: bool = True):
    """Fused flashinfer kernels on CUDA when importable and ``prefer_fused``; else ``TorchKernels``."""
    if device.type == "cuda" and prefer_fused:
        from worker.model import flashinfer_kernels

        if flashinfer_kernels.available():
            return flashinfer_kernels
        log.info("flashinfer not importable: using PyTorch element-wise kernels on %s", device)
    return TorchKernels
