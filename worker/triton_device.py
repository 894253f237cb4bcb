"""A Triton kernel for a tensor's device: compiled on CUDA, Triton's interpreter on CPU.

The CPU test suite runs our kernels on CPU tensors through the interpreter (slowly); the serving
path never does. Shared by every launcher of ours (the RoPE store, the fused decode-layer kernels).
"""

from __future__ import annotations

import functools

import torch


def kernel_for(kernel, device: torch.device):
    """``kernel`` (a ``triton.jit`` function) to launch on ``device``: itself on CUDA, else the same
    kernel in Triton's interpreter (built once per kernel)."""
    return kernel if device.type == "cuda" else _interpreted(kernel)


@functools.cache
def _interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


def dot_options(dtype: torch.dtype, device: torch.device) -> dict:
    """The ``DOT_PRECISION`` / ``DOT_FP32`` constexprs of a kernel whose ``tl.dot`` runs on ``dtype``
    inputs: exact float32 products for float32 inputs; in the interpreter, 16-bit operands widened to
    float32 first (it multiplies 16-bit floats wrongly), the same values."""
    cuda = device.type == "cuda"
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 or not cuda else "tf32", "DOT_FP32": not cuda}
