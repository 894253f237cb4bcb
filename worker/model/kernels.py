"""The element-wise kernels the layers call, and the choice of an implementation per device.

:class:`Kernels` is the interface (RMSNorm, fused add + RMSNorm, SiLU-and-mul, RoPE); the
layers of :mod:`worker.model.llama` call nothing else, so the same layer code runs on CPU and
GPU. Implementations: :class:`worker.model.torch_kernels.TorchKernels` (plain PyTorch, HF's
arithmetic order, any device) and :class:`worker.model.flashinfer_kernels.FlashInferKernels`
(flashinfer's fused kernels, CUDA).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from worker.model.flashinfer_kernels import FlashInferKernels
from worker.model.torch_kernels import TorchKernels

log = logging.getLogger(__name__)


class Kernels(Protocol):
    """Element-wise building blocks of a decoder layer; ``name`` says which implementation."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / rms(x) * weight`` over the last dim; a tensor shaped like ``x``."""

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``; may reuse the inputs' memory (callers never
        read their old values)."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x = [..., gate (I) | up (I)]``; returns ``[..., I]``."""

    def apply_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX-style rotary embedding of ``q`` (T, Hq*D) and ``k`` (T, Hk*D) at ``positions``."""


def select_kernels(device: torch.device, prefer_fused: bool = True) -> Kernels:
    """Fused flashinfer kernels on CUDA when importable and ``prefer_fused``; else the PyTorch ones."""
    if device.type == "cuda" and prefer_fused:
        if FlashInferKernels.available():
            return FlashInferKernels()
        log.info("flashinfer not importable: using PyTorch element-wise kernels on %s", device)
    return TorchKernels()
