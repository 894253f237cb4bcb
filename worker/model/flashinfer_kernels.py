"""flashinfer's fused element-wise kernels as a :class:`worker.model.kernels.Kernels` (CUDA only).

Selected by ``select_kernels``. The module imports on CPU: flashinfer is loaded on first use.
Each kernel JIT-loads (or compiles) on its first call, so run one eager forward before capturing
a CUDA graph; after that every call is a plain kernel launch (graph-safe). All of them compute
in fp32 internally.

Under ``torch.compile`` (``torch.compiler.is_compiling()``, decided at trace time) each kernel is
traced as its :class:`~worker.model.torch_kernels.TorchKernels` equivalent instead, which
inductor fuses; in-place results are then new tensors, which the callers' contract (never reuse
the inputs' old values) allows.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from worker.model.torch_kernels import TorchKernels


@functools.cache
def _ops() -> SimpleNamespace:
    from flashinfer.activation import silu_and_mul as fi_silu_and_mul
    from flashinfer.norm import fused_add_rmsnorm, rmsnorm
    from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

    return SimpleNamespace(rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm, silu_and_mul=fi_silu_and_mul,
                           rope_inplace=apply_rope_with_cos_sin_cache_inplace)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


class FlashInferKernels:
    """flashinfer's fused norm, activation and RoPE kernels (fp32 math inside)."""

    name = "flashinfer"

    @staticmethod
    @functools.cache
    def available() -> bool:
        """flashinfer imports and a CUDA device is present."""
        if not torch.cuda.is_available():
            return False
        try:
            _ops()
        except Exception:  # noqa: BLE001 - any import failure means "not usable"
            return False
        return True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / rms(x) * weight`` over the last dim (fp32 math); returns a new tensor shaped like ``x``."""
        if torch.compiler.is_compiling():
            return TorchKernels.rms_norm(x, weight, eps)
        return _ops().rmsnorm(_rows(x), weight.to(x.dtype), eps).view(x.shape)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rms_norm(x + residual), x + residual)`` in one kernel, IN PLACE.

        flashinfer's ``fused_add_rmsnorm`` does ``residual += x; x = rms_norm(residual) * weight``:
        when ``x`` and ``residual`` are contiguous (the usual case) the returned tensors *are* ``x``
        (now the normed output) and ``residual`` (now the sum), so callers must not reuse the inputs'
        old values. Non-contiguous inputs are copied first and left untouched. The sum is stored in
        ``residual``'s dtype and the norm is taken of the fp32 sum before that rounding.
        """
        if torch.compiler.is_compiling():
            return TorchKernels.fused_add_rms_norm(x, residual, weight, eps)
        h, r = _rows(x), _rows(residual)
        _ops().fused_add_rmsnorm(h, r, weight.to(x.dtype), eps)
        return h.view(x.shape), r.view(residual.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x = [..., gate (I) | up (I)]``; returns ``[..., I]``."""
        if torch.compiler.is_compiling():
            return TorchKernels.silu_and_mul(x)
        return _ops().silu_and_mul(x.contiguous())

    def apply_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX-style (rotate-half, as Llama) rotary embedding of ``q`` (T, Hq*D) and ``k`` (T, Hk*D), IN PLACE.

        ``cos_sin_cache`` is float32 ``(max_pos, head_dim)``, contiguous, on the device: cos of the
        ``head_dim/2`` pair frequencies, then their sin (``worker.model.rotary.cos_sin_cache``); pair
        ``i`` rotates dims ``(i, i + head_dim/2)``. ``positions`` is int64 or int32.
        ``q``/``k`` may be strided views (e.g. of a fused qkv output) as long as the last dim is
        contiguous; they are rotated in place and returned.
        """
        if torch.compiler.is_compiling():
            return TorchKernels.apply_rope(positions, q, k, head_dim, cos_sin_cache)
        _ops().rope_inplace(positions.contiguous(), q, k, head_dim, cos_sin_cache, is_neox=True)
        return q, k
