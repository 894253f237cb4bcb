"""The log-probability tail in two Triton kernels: each row's log-sum-exp, the chosen token's
log-probability, the ``width`` most likely tokens and the packed read-back rows (issue 19: top 20
on every row within 5% of a step without).

The torch path (:func:`worker.sampling.logprobs.torch_logprobs_of`, other devices) launches a
``log_softmax`` that writes a float32 copy of the logits, a gather, a chunked top-k of six kernels
and the packing: 72 us of device time for 64 rows of a 32k vocabulary as graph replays on the H200
(bench/results/logprobs-20261204T200926.json), 14 us of it without the top-k. Here:

1. :func:`_chunk_kernel`: each row cut into chunks of ``CHUNK`` columns (at most 1024 chunks a
   row); each chunk's maximum and sum of ``exp(x - max)``. One program per ``SUB`` chunks.
2. :func:`_merge_kernel`, one program per row: the row's log-sum-exp from the chunks' (max, sum)
   pairs, the chosen token's log-probability and, when ``width`` > 0, the top ``width``: the
   ``width`` chunks with the largest maxima hold the row's top ``width`` values (an entry ranked
   i has at most i - 1 larger entries, so at most i - 1 chunks have a larger maximum than its own;
   among chunks of equal maxima any choice holds values as large), so their entries are loaded
   as one (width, CHUNK) tile and the ``width`` largest are selected, then sorted (a sort of 32).
   Selection is exact, without a sort of the candidates: a bisection over the order-preserving
   int32 keys of the values (the float32 bits, negative ones with their 31 low bits flipped) for
   the ``width``-th largest key, then, among entries tied at it, the lowest columns first (a
   bisection only when the tie must be split). Both selections use it. Then the packed row of
   :mod:`worker.sampling.packed_rows`.

Arithmetic: float32 whatever the logits' dtype; ``lse = M + log(sum_c s_c * exp(m_c - M))`` over
the chunks' maxima ``m_c`` and sums ``s_c``, ``M`` the row's maximum. It differs from torch's
``log_softmax`` by float32 rounding (tests: within 4e-6 absolute on logits of scale 4 on CPU,
5e-5 on the GPU over 128k entries).

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

#: Most chunks a row is cut into (the chunk is widened until the row fits).
MAX_CHUNKS = 1024
#: Columns one chunk-kernel program reads (``SUB`` chunks of ``CHUNK``).
PROGRAM_COLUMNS = 1024


@triton.jit
def _sortable(x):
    """float32 -> int32 keys in the same order (negative floats: the 31 low bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _select(key, low, valid, zero, K: tl.constexpr):
    """Mask of the K largest valid entries by (int32 ``key``, then unique int ``low``), all valid
    ones when fewer; ``zero``: an int64 scalar 0 (the bisections' carried bounds are int64)."""
    key = key.to(tl.int64)
    lo = zero - 2147483648
    hi = zero + 2147483647
    for _ in range(32):  # the largest k with at least K valid keys >= k: the K-th largest key
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((valid & (key >= mid)).to(tl.int32), axis=0) >= K
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = valid & (key > lo)
    tied = valid & (key == lo)
    need = K - tl.sum(above.to(tl.int32), axis=0)
    floor = zero
    if tl.sum(tied.to(tl.int32), axis=0) > need:  # split the tie: the ``need`` largest ``low``
        top = zero + 2147483647
        for _ in range(31):
            mid = (floor + top + 1) >> 1
            enough = tl.sum((tied & (low >= mid)).to(tl.int32), axis=0) >= need
            floor = tl.where(enough, mid, floor)
            top = tl.where(enough, top, mid - 1)
    return above | (tied & (low >= floor))


@triton.jit
def _chunk_kernel(logits_ptr, row_stride, vocab, stats_ptr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                  SUB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    sub = tl.program_id(1) * SUB + tl.arange(0, SUB)
    cols = sub[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=1)
    total = tl.sum(tl.exp(x - tl.where(top == float("-inf"), 0.0, top)[:, None]), axis=1)
    at = (row * CHUNKS + sub) * 2
    tl.store(stats_ptr + at, top, mask=sub < CHUNKS)
    tl.store(stats_ptr + at + 1, total, mask=sub < CHUNKS)


@triton.jit
def _merge_kernel(logits_ptr, row_stride, vocab, tokens_ptr, stats_ptr, scratch_ptr, chosen_ptr, ids_ptr,
                  values_ptr, packed_ptr, CHUNKS: tl.constexpr, CHUNKS_P: tl.constexpr, CHUNK: tl.constexpr,
                  K: tl.constexpr, K_P: tl.constexpr):
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
        zero = row * 0
        lane = tl.arange(0, K_P)
        scratch = scratch_ptr + row * K_P
        # the K chunks with the largest maxima (lower chunk first among equal maxima), compacted
        pick = _select(_sortable(maxima), 0x7FFFFFFF - c, live, zero, K)
        tl.store(scratch + tl.cumsum(pick.to(tl.int32), axis=0) - 1, c.to(tl.int64), mask=pick)
        picked = tl.sum(pick.to(tl.int32), axis=0)
        tl.debug_barrier()
        chunk_of = tl.load(scratch + lane, mask=lane < picked, other=0)
        tl.debug_barrier()  # every lane has read the chunks before the scratch is reused below
        cols = tl.reshape(chunk_of[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :], [K_P * CHUNK])
        inside = tl.reshape((lane < picked)[:, None] & (tl.arange(0, CHUNK) < CHUNK)[None, :], [K_P * CHUNK])
        inside = inside & (cols < vocab)
        x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
        key = _sortable(x)
        low = 0x7FFFFFFF - cols
        best = _select(key, low, inside, zero, K)
        tl.store(scratch + tl.cumsum(best.to(tl.int32), axis=0) - 1,
                 (key.to(tl.int64) << 32) + low.to(tl.int64), mask=best)
        tl.debug_barrier()
        lowest = (zero + (-2147483647 - 1)) << 32
        ranked = tl.sort(tl.load(scratch + lane, mask=lane < K, other=lowest), descending=True)
        key = ranked >> 32
        column = 0x7FFFFFFF - (ranked - (key << 32))
        key32 = key.to(tl.int32)
        value = tl.where(key32 >= 0, key32, key32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True) - lse
        first = lane < K
        tl.store(ids_ptr + row * K + lane, column, mask=first)
        tl.store(values_ptr + row * K + lane, value, mask=first)
        tl.store(packed_row + 2 + lane, column.to(tl.int32), mask=first)
        tl.store(packed_row + 2 + K + lane, value.to(tl.int32, bitcast=True), mask=first)


def chunk_width(vocab: int) -> int:
    """Columns per chunk: 32, doubled until a row has at most :data:`MAX_CHUNKS` chunks (32k
    vocabulary: 32; 128k: 128)."""
    chunk = 32
    while triton.cdiv(vocab, chunk) > MAX_CHUNKS:
        chunk *= 2
    return chunk


def logprob_tail(logits: torch.Tensor, tokens: torch.Tensor, width: int, chunk: int | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(log-probabilities of ``tokens`` (B,) under ``logits`` (B, V) of any float dtype, the
    ``width`` most likely ids (B, width) int64 and their log-probabilities (float32), None when
    ``width`` is 0, and the (B, 2 + 2 * width) int32 packed rows of
    :func:`worker.sampling.packed_rows.pack`).

    ``logits`` may be a row view (any row stride, contiguous columns); ``tokens`` int32 or int64
    ids below V; 0 <= ``width`` <= min(V, 64). The top entries come sorted, largest first; among
    equal values the lower id first, except that among chunks of equal maxima the lower chunks
    are searched (equal values either way). ``chunk``: columns per chunk, a power of two giving at
    most :data:`MAX_CHUNKS` chunks (default :func:`chunk_width`)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be floating with contiguous columns, got {logits.dtype} "
                         f"strides {logits.stride()}")
    if tokens.shape != (rows,) or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tokens must be ({rows},) int32 or int64, got {tuple(tokens.shape)} {tokens.dtype}")
    if not 0 <= width <= min(vocab, 64):
        raise ValueError(f"width must be in [0, {min(vocab, 64)}], got {width}")
    chunk = chunk_width(vocab) if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1) or triton.cdiv(vocab, chunk) > MAX_CHUNKS:
        raise ValueError(f"chunk must be a power of two giving at most {MAX_CHUNKS} chunks of {vocab} columns, "
                         f"got {chunk}")
    chunks = triton.cdiv(vocab, chunk)
    sub = max(1, min(PROGRAM_COLUMNS // chunk, triton.next_power_of_2(chunks)))
    k_p = max(2, triton.next_power_of_2(width))
    device = logits.device
    stats = torch.empty(rows, chunks, 2, dtype=torch.float32, device=device)
    scratch = torch.empty(rows, k_p, dtype=torch.int64, device=device)
    chosen = torch.empty(rows, dtype=torch.float32, device=device)
    ids = torch.empty(rows, width, dtype=torch.int64, device=device)
    values = torch.empty(rows, width, dtype=torch.float32, device=device)
    packed = torch.empty(rows, 2 + 2 * width, dtype=torch.int32, device=device)
    if rows:
        _kernel(_chunk_kernel, device)[(rows, triton.cdiv(chunks, sub))](
            logits, logits.stride(0), vocab, stats, CHUNKS=chunks, CHUNK=chunk, SUB=sub, num_warps=4)
        _kernel(_merge_kernel, device)[(rows,)](
            logits, logits.stride(0), vocab, tokens, stats, scratch, chosen, ids, values, packed,
            CHUNKS=chunks, CHUNKS_P=max(2, triton.next_power_of_2(chunks)), CHUNK=chunk, K=width, K_P=k_p,
            num_warps=8)
    if not width:
        return chosen, None, None, packed
    return chosen, ids, values, packed


def _kernel(kernel, device: torch.device):
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError("fused log-probabilities on a non-CUDA device need Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")
    return kernel
