"""Our Triton kernels as the flashinfer backend takes them: each where Triton imports and the
kernel serves the attention shape, else None (the backend then runs flashinfer's kernels alone).

* :func:`rope_store_launch`: RoPE and the KV write in one kernel (``worker/attention/rope_store.py``).
* :func:`decode_attention_kernel`: RoPE, the KV write and decode attention in one kernel
  (``worker/attention/fused_decode.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from worker.attention.base import AttentionShape


def rope_store_launch(head_dim: int) -> Callable[..., None] | None:
    """The fused RoPE + KV-write launch (:func:`worker.attention.rope_store.launch`), or None."""
    try:
        from worker.attention.rope_store import launch, supports
    except Exception:  # noqa: BLE001 - no Triton (or a broken one)
        return None
    return launch if supports(head_dim) else None


def decode_attention_kernel(shape: AttentionShape, max_rows: int, device: torch.device) -> Any | None:
    """A :class:`worker.attention.fused_decode.FusedDecodeAttention` for ``shape`` on ``device``'s
    SMs and up to ``max_rows`` rows, or None."""
    try:
        from worker.attention.fused_decode import FusedDecodeAttention, supports
    except Exception:  # noqa: BLE001 - no Triton (or a broken one)
        return None
    if not supports(shape.num_q_heads, shape.num_kv_heads, shape.head_dim):
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return FusedDecodeAttention(shape.num_q_heads, shape.num_kv_heads, shape.head_dim, max_rows, sms, device)
