"""Choosing and building the attention backend named by ``attention.backend``."""

from __future__ import annotations

import logging
from typing import Any

from worker.attention.base import AttentionBackend, AttentionShape
from worker.kv_cache import PagedKVCache

log = logging.getLogger(__name__)


def flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


#: The settings of an ``attention`` config section that only the flashinfer backend reads.
FLASHINFER_OPTIONS = ("fast_decode_plan", "fused_rope_store", "decode_graph_split_kv", "prefill_kernel",
                      "decode_kernel", "fused_decode")


def flashinfer_options(config: Any) -> dict[str, Any]:
    """The flashinfer settings of ``config`` (an ``AttentionConfig``) as keyword arguments of
    :func:`create_attention_backend`."""
    return {name: getattr(config, name) for name in FLASHINFER_OPTIONS}


def create_attention_backend(name: str, shape: AttentionShape, kv_cache: PagedKVCache, max_num_rows: int,
                             max_num_tokens: int, max_pages_per_row: int, *,
                             fast_decode_plan: bool = False, fused_rope_store: bool = False,
                             decode_graph_split_kv: bool | str = True, prefill_kernel: str = "fa2",
                             decode_kernel: str = "fa2", fused_decode: bool = False) -> AttentionBackend:
    """``auto`` takes flashinfer when the cache is on CUDA and flashinfer imports, else torch.
    ``fast_decode_plan``, ``fused_rope_store``, ``decode_graph_split_kv``, ``prefill_kernel``,
    ``decode_kernel`` and ``fused_decode`` are flashinfer's (:class:`FlashInferBackend`); the torch backend is the
    reference and keeps its plain RoPE and store."""
    if name == "auto":
        name = "flashinfer" if kv_cache.device.type == "cuda" and flashinfer_importable() else "torch"
        if name == "torch" and kv_cache.device.type == "cuda":
            log.warning("attention.backend=auto: flashinfer not importable, using the torch reference backend")
    if name == "torch":
        from worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(shape, kv_cache, max_num_rows, max_num_tokens, max_pages_per_row)
    if name == "flashinfer":
        if kv_cache.device.type != "cuda":
            raise ValueError("attention.backend=flashinfer needs a CUDA device; use attention.backend=torch on CPU")
        from worker.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(shape, kv_cache, max_num_rows, max_num_tokens, max_pages_per_row,
                                 fast_decode_plan=fast_decode_plan, fused_rope_store=fused_rope_store,
                                 decode_graph_split_kv=decode_graph_split_kv, prefill_kernel=prefill_kernel,
                                 decode_kernel=decode_kernel, fused_decode=fused_decode)
    raise ValueError(f"attention.backend={name!r}; allowed: auto, torch, flashinfer")
