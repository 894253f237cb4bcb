"""One Triton kernel from a decode layer's residual stream to rotated queries and a written KV cache.

:mod:`worker.model.norm_linear` folds the residual add and RMSNorm into the qkv projection; this
kernel also folds in what follows it, RoPE and the KV-cache write
(:mod:`worker.attention.rope_store`'s job): each program owns ``BLOCK_P`` rotation pairs
``(d, d + head_dim/2)`` of one head, so it holds both halves of every pair it rotates. A query
head's pairs are rotated and stored in the ``(rows, q_heads * head_dim)`` output, a key head's
rotated into the cache page of each row's planned location, a value head's copied there. A layer
then runs five kernels (this one, attention, o_proj, norm + gate/up + SiLU-and-mul, down).

Arithmetic: :mod:`worker.model.norm_linear`'s up to the projection (bias added in float32, then
q, k and v rounded to the dtype, as the unfused projection's output is), then rope_store's RoPE
(NeoX rotate-half, float32 cos/sin of the ``(max_pos, head_dim)`` table, rounded once). Cache
layout and locations as :mod:`worker.attention.rope_store`'s. Not for models with q/k norms
(Qwen3 normalises each head before RoPE): :func:`supports` says which shapes qualify.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.model.norm_linear import multiply_add, normed_tile, row_scale, row_tile, tiling_for
from worker.triton_device import dot_options, kernel_for


@triton.jit(do_not_specialize=["M"])
def _norm_qkv_rope_kernel(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, q_ptr, res_ptr, pos_ptr, loc_ptr, cos_sin_ptr,
                          cache_ptr, M, K, x_row, r_row, eps, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                          NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    per_head: tl.constexpr = HALF // BLOCK_P
    head = pid // per_head
    p = (pid % per_head) * BLOCK_P + tl.arange(0, BLOCK_P)  # the pairs' first dims within the head
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    dtype = x_ptr.dtype.element_ty
    scale = row_scale(x_ptr, r_ptr, res_ptr, M, K, x_row, r_row, eps, pid == 0, HAS_RESIDUAL, BLOCK_M, BLOCK_K)

    first = head * (2 * HALF) + p  # weight rows (= qkv output columns) of the pairs' two halves
    second = first + HALF
    every = p < HALF
    acc1 = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = normed_tile(x_ptr, r_ptr, g_ptr, M, K, x_row, r_row, k0, scale, True, HAS_RESIDUAL, BLOCK_M, BLOCK_K,
                        DOT_FP32)
        acc1 = multiply_add(acc1, a, w_ptr, first, K, k0, every, BLOCK_M, BLOCK_K, DOT_PRECISION, DOT_FP32)
        acc2 = multiply_add(acc2, a, w_ptr, second, K, k0, every, BLOCK_M, BLOCK_K, DOT_PRECISION, DOT_FP32)
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + first).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + second).to(tl.float32)[None, :]
    x1 = acc1.to(dtype).to(tl.float32)  # the projection's output, rounded as the unfused one's
    x2 = acc2.to(dtype).to(tl.float32)

    pos = tl.load(pos_ptr + rm, mask=m_mask, other=0).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos[:, None] * (2 * HALF) + p[None, :], mask=m_mask[:, None], other=0.0)
    sin = tl.load(cos_sin_ptr + pos[:, None] * (2 * HALF) + HALF + p[None, :], mask=m_mask[:, None], other=0.0)
    rotated1 = x1 * cos - x2 * sin
    rotated2 = x2 * cos + x1 * sin

    # Which of q, k, v this head is, as row counts (a scalar condition in a mask trips the interpreter).
    q_rows = tl.where(head < NUM_Q_HEADS, M, 0)
    kv_rows = tl.where(head < NUM_Q_HEADS, 0, M)
    is_v = tl.where(head >= NUM_Q_HEADS + NUM_KV_HEADS, 1, 0)
    q_mask = (rm < q_rows)[:, None] & every[None, :]
    q_at = q_ptr + rm[:, None] * (NUM_Q_HEADS * 2 * HALF) + head * (2 * HALF) + p[None, :]
    tl.store(q_at, rotated1.to(dtype), mask=q_mask)
    tl.store(q_at + HALF, rotated2.to(dtype), mask=q_mask)

    loc = tl.load(loc_ptr + rm, mask=m_mask, other=0).to(tl.int64)
    kv_head = head - NUM_Q_HEADS - is_v * NUM_KV_HEADS
    slot_row: tl.constexpr = NUM_KV_HEADS * 2 * HALF
    page = loc // PAGE_SIZE
    dst = cache_ptr + ((page * 2 + is_v) * PAGE_SIZE + loc % PAGE_SIZE)[:, None] * slot_row \
        + kv_head * (2 * HALF) + p[None, :]
    out = cache_ptr.dtype.element_ty
    kv_mask = (rm < kv_rows)[:, None] & every[None, :]
    keep = is_v.to(tl.float32)  # values are stored as projected, keys rotated
    tl.store(dst, (keep * x1 + (1.0 - keep) * rotated1).to(out), mask=kv_mask)
    tl.store(dst + HALF, (keep * x2 + (1.0 - keep) * rotated2).to(out), mask=kv_mask)


def supports(head_dim: int, q_heads: int, kv_heads: int, has_qk_norm: bool) -> bool:
    """Whether a layer of this attention shape can take the kernel: half of ``head_dim`` a power of two
    of at least 16 (a pair block is a ``tl.dot`` operand), no per-head q/k norm before RoPE."""
    half = head_dim // 2
    return not has_qk_norm and head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0 and q_heads > 0 \
        and kv_heads > 0


def launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
           weight: torch.Tensor, bias: torch.Tensor | None, q_heads: int, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor, cache: torch.Tensor, locations: torch.Tensor,
           block_p: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated queries ``(rows, q_heads * head_dim)`` and the new residual of ``x`` (rows <= 16); writes
    rotated keys and the values of every row at its flat location in one layer's ``cache`` (pages,
    2, page_size, kv_heads, head_dim). ``weight`` stacks the q, k and v rows (+ ``bias``); ``positions``
    and ``locations`` hold a row's entry at its index; ``block_p``: rotation pairs a program owns
    (16, the least a ``tl.dot`` operand takes, or 32). Unchecked: the caller's inputs hold
    :func:`supports` and :mod:`worker.model.norm_linear`'s shapes by construction (a decoder layer)."""
    m, k = x.shape
    _, _, page_size, kv_heads, head_dim = cache.shape
    half = head_dim // 2
    heads = q_heads + 2 * kv_heads
    q = torch.empty((m, q_heads * head_dim), dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    extra = {"num_warps": 4, "num_stages": 3} if x.device.type == "cuda" else {}
    unused = weight  # a valid pointer for the arguments a constexpr switch leaves unread
    kernel_for(_norm_qkv_rope_kernel, x.device)[(heads * (half // block_p),)](
        x, residual if residual is not None else unused, norm_weight, weight, bias if bias is not None else unused,
        q, new_residual, positions, locations, cos_sin_cache, cache, m, k, x.stride(0),
        residual.stride(0) if residual is not None else 0, eps, HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, NUM_Q_HEADS=q_heads, NUM_KV_HEADS=kv_heads, HALF=half, PAGE_SIZE=page_size,
        BLOCK_M=row_tile(m), BLOCK_P=block_p, BLOCK_K=tiling_for(2 * block_p, k, m).block_k,
        **dot_options(x.dtype, x.device), **extra)
    return q, new_residual
