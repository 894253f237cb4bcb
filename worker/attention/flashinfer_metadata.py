"""flashinfer's host side for :class:`worker.attention.flashinfer_backend.FlashInferBackend`: the CSR
metadata of one step (what it writes into its pinned host twin before each ``plan``), and the
choices it makes from its settings before any kernel runs: the kernel family, the KV split of
captured decode shapes, which plans the fast decode plan reproduces."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from worker.attention.base import AttentionBatch, AttentionShape, locations_of, row_geometry


def build_metadata(batch: AttentionBatch, page_size: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Host-side flashinfer CSR metadata for ``batch``, as int64 arrays (``indices`` int32).

    Returns ``(qo_indptr, kv_indptr, last_page_len, indices, locations)``. A row with ``seq_len=0``
    (prefill sentinel) gets zero pages and ``last_page_len=0``, which flashinfer reads as an
    empty request both on the host (``get_seq_lens``) and in its kernels; otherwise
    ``1 <= last_page_len <= page_size``.
    """
    seq, q, need = row_geometry(batch, page_size)
    rows = batch.page_tables
    qo = np.zeros(len(seq) + 1, dtype=np.int64)
    kv = np.zeros(len(seq) + 1, dtype=np.int64)
    np.cumsum(q, out=qo[1:])
    np.cumsum(need, out=kv[1:])
    last = seq - (need - 1) * page_size
    last[need == 0] = 0
    # row_geometry checked every row holds at least the pages it needs, so equal totals mean the
    # pages cover exactly the tokens (the usual case): the rows' indices serve as they are.
    if kv[-1] == len(rows.indices):
        indices = rows.indices
    else:  # only the pages covering seq_len
        indices = rows.indices[np.repeat(rows.indptr[:-1] - kv[:-1], need) + np.arange(kv[-1], dtype=np.int64)]
    return qo, kv, last, indices, locations_of(rows, seq, q, page_size, batch.num_tokens)


def graph_decode_split_rows(setting: bool | str, num_kv_heads: int, num_sms: int) -> float:
    """Captured decode shapes of fewer rows than this split each row's KV (``setting``: True, False,
    or ``"auto"``). Auto splits while one unsplit pass (a CTA per row and KV head) would leave SMs
    idle, ``rows * num_kv_heads < num_sms``, and not once it fills them: measured on the H200 at
    context 512 (decode-20261204T013500), no split was 4-5% faster at batch 64 and 256 on
    tinyllama-1.1b (4 KV heads), a wash on llama-3-8b (8), and 1.5-10% slower at batch 1 and 8."""
    if isinstance(setting, bool):
        return math.inf if setting else 0
    if setting != "auto":
        raise ValueError(f"decode_graph_split_kv must be true, false or 'auto', got {setting!r}")
    return -(-num_sms // num_kv_heads)  # rows * heads < sms  <=>  rows < ceil(sms / heads)


def graph_decode_splits_kv(setting: bool | str, rows: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a captured decode shape of ``rows`` rows splits each row's KV (see
    :func:`graph_decode_split_rows`)."""
    return rows < graph_decode_split_rows(setting, num_kv_heads, num_sms)


KERNELS = ("fa2", "fa3")


def check_kernels(prefill_kernel: str, decode_kernel: str, decode_use_tensor_cores: bool,
                  capability: tuple[int, int]) -> None:
    """Raise ``ValueError`` naming the setting unless these kernel families can run here: each is
    one of :data:`KERNELS`; fa3 needs a Hopper GPU (compute capability 9.x, ``capability``) and,
    for decode, the tensor-core path (fa3 has no CUDA-core decode kernel)."""
    for name, kernel in (("prefill_kernel", prefill_kernel), ("decode_kernel", decode_kernel)):
        if kernel not in KERNELS:
            raise ValueError(f"attention.{name}={kernel!r}; allowed: {', '.join(KERNELS)}")
        if kernel == "fa3" and capability[0] != 9:
            raise ValueError(f"attention.{name}=fa3 needs a Hopper GPU (sm_90); this one is "
                             f"sm_{capability[0]}{capability[1]}: use fa2")
    if decode_kernel == "fa3" and not decode_use_tensor_cores:
        raise ValueError("attention.decode_kernel=fa3 runs only as tensor-core decode; "
                         "it cannot go with decode_use_tensor_cores=False")


def fast_plan_applies(wrapper: Any) -> bool:
    """Whether ``wrapper`` (just planned the ordinary way) is the case :meth:`FlashInferBackend._fast_plan`
    reproduces: a CUDA-graph decode wrapper on flashinfer's tensor-core fa2 path with one query
    token a row, no window and no JIT module of its own."""
    a = getattr
    return (wrapper.is_cuda_graph_enabled and a(wrapper, "use_tensor_cores", False)
            and a(wrapper, "_backend", None) == "fa2" and a(wrapper, "_jit_module", 0) is None
            and a(wrapper, "_q_len_per_req", None) == 1 and a(wrapper, "_window_left", None) == -1
            and not a(wrapper, "_uses_cudnn", False) and a(wrapper, "_cached_module", None) is not None
            and hasattr(wrapper, "_pin_memory_int_workspace_buffer") and a(wrapper, "_plan_info", None) is not None)


def fast_decode_plan(wrapper: Any, shape: AttentionShape, page_size: int, rows: int, qo_indptr: Any, kv_indptr: Any,
                     kv_lens: Any, split_kv: bool) -> None:
    """Re-plan a graph decode wrapper (planned the ordinary way before, same shape) through
    flashinfer's compiled scheduler alone: its indptr and last_page_len regions are on the device
    already. ``qo_indptr``, ``kv_indptr`` and ``kv_lens`` are pinned host int32 tensors of at least
    ``rows + 1`` / ``rows + 1`` / ``rows`` entries (padding rows: one token each). The arguments
    mirror ``BatchDecodeWithPagedKVCacheWrapper.plan`` of flashinfer 0.7.2 (tensor cores, fa2, one
    query token a row, no window, no fixed split; causal, window_left, fixed_split_size,
    disable_split_kv, num_colocated_ctas, uniform_q_len last)."""
    # Only the plan info changes: the fa2 run reads no other state plan sets (``_max_kv_len``
    # is the trtllm-gen and cute-dsl paths').
    wrapper._plan_info = wrapper._cached_module.plan(
        wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
        qo_indptr[: rows + 1], kv_indptr[: rows + 1], kv_lens[:rows], rows, rows, shape.num_q_heads,
        shape.num_kv_heads, page_size, True, shape.head_dim, shape.head_dim, False, -1, -1, not split_kv, 0, 0)
