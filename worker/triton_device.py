"""A Triton kernel for a tensor's device: compiled on CUDA, Triton's interpreter on CPU.

The CPU test suite runs our kernels on CPU tensors through the interpreter (slowly); the serving
path never does. Used by the RoPE + KV-write launcher (worker/attention/rope_store.py).
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

