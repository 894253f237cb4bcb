"""The log-probability tail in two Triton kernels: each row's log-sum-exp, the chosen token's
log-probability, the ``width`` most likely tokens and the packed read-back rows, reading the
logits once (issue 19: top 20 on every row within 5% of a step without).

The torch path (:func:`worker.sampling.logprobs.logprobs_of` on other devices) launches a
``log_softmax`` that writes a float32 copy of the logits, a gather, a chunked top-k of six kernels
and the packing; on the H200 its top-k alone (``sbtopk::gatherTopK``) was 35 us of a 1.6 ms
tinyllama step at batch 64 (bench/results/step_profile-20261204T153242.json). Here:

1. :func:`_chunk_kernel`, one program per (row, chunk of ``CHUNK`` columns): the chunk's maximum,
   its sum of ``exp(x - max)`` and, when ``width`` > 0, its ``width`` largest entries (one bitonic
   ``tl.sort`` of the chunk).
2. :func:`_merge_kernel`, one program per row: the row's log-sum-exp from the chunks' (max, sum)
   pairs, the chosen token's log-probability, the top ``width`` of the chunks' candidates (every
   entry of the row's top ``width`` is among its chunk's top ``width``), and the packed row of
   :mod:`worker.sampling.packed_rows`.

A candidate is one int64: the float32 bits made order-preserving as a signed int32 (negative
floats have their 31 low bits flipped) in the high half, ``0x7FFFFFFF - column`` in the low half,
so one integer sort orders by value and, among equal values, by lower column first. Columns past
the vocabulary carry the smallest key and sort last.

Arithmetic: float32 whatever the logits' dtype; ``lse = M + log(sum_c s_c * exp(m_c - M))`` over
the chunks' maxima ``m_c`` and sums ``s_c``, ``M`` the row's maximum. It differs from torch's
``log_softmax`` by float32 rounding (tests: within 2e-6 absolute on logits of unit scale).

Import it only where Triton is present. CUDA tensors run the compiled kernels; CPU tensors run
them in Triton's interpreter, which must be switched on before triton is imported
(``TRITON_INTERPRET=1``; the CPU test suite does it in ``tests/conftest.py``). The serving path
calls it for CUDA tensors only. Graph-safe: two launches, outputs and scratch from the caching
allocator (the graph pool under capture), no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["chunk_width", "logprob_tail"]

#: Most candidates one row's merge sorts (the chunk is widened until the row fits).
MAX_CANDIDATES = 2048


@triton.jit
def _chunk_kernel(logits_ptr, row_stride, vocab, stats_ptr, cand_ptr,
                  CHUNKS: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    total = tl.sum(tl.exp(x - tl.where(top == float("-inf"), 0.0, top)), axis=0)
    at = (row * CHUNKS + chunk) * 2
    tl.store(stats_ptr + at, top)
    tl.store(stats_ptr + at + 1, total)
    if K > 0:
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(inside, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), -2147483647 - 1)
        ranked = tl.sort((key.to(tl.int64) << 32) + (0x7FFFFFFF - cols).to(tl.int64), descending=True)
        lane = tl.arange(0, CHUNK)
        tl.store(cand_ptr + (row * CHUNKS + chunk) * K + lane, ranked, mask=lane < K)


@triton.jit
def _merge_kernel(logits_ptr, row_stride, tokens_ptr, stats_ptr, cand_ptr, chosen_ptr, ids_ptr, values_ptr,
                  packed_ptr, CHUNKS: tl.constexpr, CHUNKS_P: tl.constexpr, K: tl.constexpr,
                  CANDIDATES_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P)
    live = c < CHUNKS
    maxima = tl.load(stats_ptr + (row * CHUNKS + c) * 2, mask=live, other=float("-inf"))
    sums = tl.load(stats_ptr + (row * CHUNKS + c) * 2 + 1, mask=live, other=0.0)
    top = tl.max(maxima, axis=0)
    lse = top + tl.log(tl.sum(tl.where(live, sums * tl.exp(maxima - top), 0.0), axis=0))
    token = tl.load(tokens_ptr + row).to(tl.int64)
    chosen = tl.load(logits_ptr + row * row_stride + token).to(tl.float32) - lse
    tl.store(chosen_ptr + row, chosen)
    packed_row = packed_ptr + row * (2 + 2 * K)
    tl.store(packed_row, token.to(tl.int32))
    tl.store(packed_row + 1, chosen.to(tl.int32, bitcast=True))
    if K > 0:
        j = tl.arange(0, CANDIDATES_P)
        lowest = (tl.zeros([CANDIDATES_P], tl.int64) + (-2147483647 - 1)) << 32
        ranked = tl.sort(tl.load(cand_ptr + row * (CHUNKS * K) + j, mask=j < CHUNKS * K, other=lowest),
                         descending=True)
        key = ranked >> 32
        column = 0x7FFFFFFF - (ranked - (key << 32))
        key32 = key.to(tl.int32)
        value = tl.where(key32 >= 0, key32, key32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True) - lse
        first = j < K
        tl.store(ids_ptr + row * K + j, column, mask=first)
        tl.store(values_ptr + row * K + j, value, mask=first)
        tl.store(packed_row + 2 + j, column.to(tl.int32), mask=first)
        tl.store(packed_row + 2 + K + j, value.to(tl.int32, bitcast=True), mask=first)


def chunk_width(vocab: int, width: int) -> int:
    """Columns per chunk: 1024, doubled until a row's candidates (chunks x ``width``) fit
    :data:`MAX_CANDIDATES` (32k vocabulary, width 20: 1024; 128k: 2048)."""
    chunk = 1024
    while width and triton.cdiv(vocab, chunk) * width > MAX_CANDIDATES:
        chunk *= 2
    return chunk


def logprob_tail(logits: torch.Tensor, tokens: torch.Tensor, width: int, chunk: int | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(log-probabilities of ``tokens`` (B,) under ``logits`` (B, V) of any float dtype, the
    ``width`` most likely ids (B, width) int64 and their log-probabilities (float32), None when
    ``width`` is 0, and the (B, 2 + 2 * width) int32 packed rows of
    :func:`worker.sampling.packed_rows.pack`).

    ``logits`` may be a row view (any row stride, contiguous columns); ``tokens`` int32 or int64
    ids below V; 0 <= ``width`` <= V. The top entries come sorted, largest first; among equal
    values the lower id first. ``chunk``: columns per chunk, a power of two >= ``width`` (default
    :func:`chunk_width`; the CPU tests pass small ones, the interpreter's sort being slow)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be floating with contiguous columns, got {logits.dtype} "
                         f"strides {logits.stride()}")
    if tokens.shape != (rows,) or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tokens must be ({rows},) int32 or int64, got {tuple(tokens.shape)} {tokens.dtype}")
    if not 0 <= width <= vocab:
        raise ValueError(f"width must be in [0, {vocab}], got {width}")
    chunk = chunk_width(vocab, width) if chunk is None else chunk
    if chunk < max(width, 1) or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= width {width}, got {chunk}")
    chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    stats = torch.empty(rows, chunks, 2, dtype=torch.float32, device=device)
    candidates = torch.empty(rows, chunks * max(width, 1), dtype=torch.int64, device=device)
    chosen = torch.empty(rows, dtype=torch.float32, device=device)
    ids = torch.empty(rows, max(width, 1), dtype=torch.int64, device=device)
    values = torch.empty(rows, max(width, 1), dtype=torch.float32, device=device)
    packed = torch.empty(rows, 2 + 2 * width, dtype=torch.int32, device=device)
    if rows:
        _kernel(_chunk_kernel, device)[(rows, chunks)](
            logits, logits.stride(0), vocab, stats, candidates, CHUNKS=chunks, CHUNK=chunk, K=width, num_warps=4)
        _kernel(_merge_kernel, device)[(rows,)](
            logits, logits.stride(0), tokens, stats, candidates, chosen, ids, values, packed,
            CHUNKS=chunks, CHUNKS_P=max(2, triton.next_power_of_2(chunks)), K=width,
            CANDIDATES_P=max(2, triton.next_power_of_2(chunks * width)), num_warps=8)
    if not width:
        return chosen, None, None, packed
    return chosen, ids, values, packed


def _kernel(kernel, device: torch.device):
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError("fused log-probabilities on a non-CUDA device need Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")
    return kernel
