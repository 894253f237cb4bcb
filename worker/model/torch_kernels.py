"""The element-wise kernels in plain PyTorch (any device), in HF transformers' arithmetic order.

Reproducing HF's order exactly makes fp32 logits match HF's to rounding. The methods are
static: the class itself and its instances both serve as :class:`worker.model.kernels.Kernels`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchKernels:
    """Reference kernels in plain PyTorch (any device); never modifies its inputs."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / rms(x) * weight`` over the last dim, the mean square taken in fp32."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    @staticmethod
    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``, the sum rounded to the inputs' dtype first."""
        residual = x + residual
        return TorchKernels.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x = [..., gate (I) | up (I)]``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of ``q`` and ``k``; returns new tensors."""
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
