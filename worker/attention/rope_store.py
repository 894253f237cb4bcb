"""One Triton kernel for RoPE and the KV-cache write: rotate ``q`` in place and write rotated ``k``
and ``v`` into the paged cache, where the unfused path launches flashinfer's RoPE and then its
``append_paged_kv_cache`` (two kernels a layer, with rotated ``k`` written out and read back).

Import it only where Triton is present. CUDA tensors run the compiled kernel; CPU tensors run
the same kernel in Triton's interpreter, slowly: that is for the CPU test suite (the serving
path never calls it on CPU, where the torch attention backend keeps RoPE and its store apart).

The arithmetic is flashinfer's RoPE: NeoX rotate-half, cos/sin from a float32 ``(max_pos, head_dim)`` cache (cos of the
``head_dim/2`` pair frequencies, then their sin), products and sums in float32, rounded once to
the output dtype.

Cache layout (:class:`worker.kv_cache.PagedKVCache`, one layer)::

    cache[page, 0 (k) | 1 (v), offset_in_page, kv_head, head_dim]   contiguous

A token at flat location ``loc`` writes page ``loc // page_size``, offset ``loc % page_size``;
padding tokens carry a location on the dummy page like every other writer's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.triton_device import kernel_for


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, q_row, k_row, v_row, pos_ptr, loc_ptr, cos_sin_ptr, cache_ptr,
                       NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_KV: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + d)[None, :]

    hq = tl.arange(0, BLOCK_Q)[:, None]
    q_mask = hq < NUM_Q_HEADS
    q_at = q_ptr + t * q_row + hq * (2 * HALF) + d[None, :]
    q1 = tl.load(q_at, mask=q_mask).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=q_mask).to(tl.float32)
    tl.store(q_at, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_at + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    hk = tl.arange(0, BLOCK_KV)[:, None]
    kv_mask = hk < NUM_KV_HEADS
    head = hk * (2 * HALF) + d[None, :]
    page = loc // PAGE_SIZE
    slot_row = NUM_KV_HEADS * 2 * HALF
    k_dst = cache_ptr + ((page * 2) * PAGE_SIZE + loc % PAGE_SIZE) * slot_row + head
    v_dst = k_dst + PAGE_SIZE * slot_row
    k_at = k_ptr + t * k_row + head
    k1 = tl.load(k_at, mask=kv_mask).to(tl.float32)
    k2 = tl.load(k_at + HALF, mask=kv_mask).to(tl.float32)
    out = cache_ptr.dtype.element_ty
    tl.store(k_dst, (k1 * cos - k2 * sin).to(out), mask=kv_mask)
    tl.store(k_dst + HALF, (k2 * cos + k1 * sin).to(out), mask=kv_mask)
    v_at = v_ptr + t * v_row + head
    tl.store(v_dst, tl.load(v_at, mask=kv_mask).to(out), mask=kv_mask)
    tl.store(v_dst + HALF, tl.load(v_at + HALF, mask=kv_mask).to(out), mask=kv_mask)


def supports(head_dim: int) -> bool:
    """Whether the kernel handles ``head_dim`` (half of it must be a power of two: 64, 128, 256)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, cache: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
    """Rotate ``q`` (tokens, Hq*D) in place, write rotated ``k`` and ``v`` (tokens, Hk*D) at flat
    ``locations`` of one layer's ``cache`` (pages, 2, page_size, Hk, D); returns ``q``.

    ``q``, ``k`` and ``v`` may be strided row views (of a fused QKV output) with a contiguous last
    dim; ``k`` and ``v`` are only read. ``positions`` and ``locations`` hold one entry per token
    (int32 or int64). Graph-safe: one launch, no allocation, no host sync. Checks every input and
    names what does not fit, then :func:`launch`.
    """
    tokens = q.shape[0]
    _, two, page_size, kv_heads, head_dim = cache.shape
    if two != 2 or not supports(head_dim):
        raise ValueError(f"cache of shape {tuple(cache.shape)}: expected (pages, 2, page_size, kv_heads, head_dim) "
                         "with head_dim / 2 a power of two")
    if k.shape != (tokens, kv_heads * head_dim) or v.shape != k.shape or q.shape[1] % head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         f"{kv_heads} KV heads of {head_dim}")
    if any(x.stride(-1) != 1 for x in (q, k, v)) or not cache.is_contiguous() or not cos_sin_cache.is_contiguous():
        raise ValueError("q, k and v need a contiguous last dim, the cache and cos_sin_cache contiguous storage")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("cos_sin_cache must be float32 (max_pos, head_dim)")
    if positions.shape[0] < tokens or locations.shape[0] < tokens:
        raise ValueError(f"{tokens} tokens need as many positions ({positions.shape[0]}) and locations "
                         f"({locations.shape[0]})")
    if len({x.device for x in (q, k, v, positions, locations, cos_sin_cache, cache)}) != 1:
        raise ValueError("q, k, v, positions, locations, cos_sin_cache and the cache must share one device")
    launch(q, k, v, positions, cos_sin_cache, cache, locations)
    return q


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor, cache: torch.Tensor, locations: torch.Tensor) -> None:
    """:func:`rope_and_store` without its checks, for a caller whose inputs hold them by construction
    (the flashinfer backend on the step path: no Python checks per layer and step)."""
    tokens = q.shape[0]
    if tokens == 0:
        return
    _, _, page_size, kv_heads, head_dim = cache.shape
    q_heads = q.shape[1] // head_dim
    kernel_for(_rope_store_kernel, q.device)[(tokens,)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), positions, locations, cos_sin_cache, cache,
        NUM_Q_HEADS=q_heads, NUM_KV_HEADS=kv_heads, BLOCK_Q=triton.next_power_of_2(q_heads),
        BLOCK_KV=triton.next_power_of_2(kv_heads), HALF=head_dim // 2, PAGE_SIZE=page_size)
