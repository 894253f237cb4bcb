"""One Triton kernel for a decode layer's attention: RoPE of q and k, the KV-cache write of this
step's k and v, and paged attention of every row's query over its KV, with the KV split merged
inside the same kernel.

Where the flashinfer backend launches three kernels a decode layer (the fused RoPE + KV write of
``rope_store``, flashinfer's attention, and at small batches its split-KV merge), each a few
microseconds of mostly launch latency at short contexts, this is one launch.

Grid ``(rows, kv_heads, splits)``: a program takes one row's query heads of one KV head group
(``GROUP`` heads, padded to 16 rows for the tensor-core dots), rotates them in registers, and
attends over its share of the row's cached tokens, one ``BLOCK_N``-token tile at a time (online
softmax in float32, base 2). The program of the last split also rotates this step's k, writes
k and v into the cache at the row's location, and takes the new token into its softmax from
registers: no program reads a cache slot written in the same launch. With ``splits > 1`` each
program writes its partial (max, sum, unnormalised output) to a scratch slot and counts itself
done on a per (row, KV head) counter; the program that arrives last merges the partials (each
split's in one load, no chain of dependent loads) and resets the counter to zero, so a captured
graph replays with the counters as it found them.

Metadata is flashinfer's paged layout for one query token a row: ``kv_indptr`` (rows + 1),
``kv_indices`` and ``kv_last_page_len`` (rows); a row's length (this step's token included) is
``(pages - 1) * page_size + last_page_len``. Padding rows (one token on the dummy page) attend to
their own token only. Cache layout as ``rope_store``'s: ``(pages, 2, page_size, kv_heads, D)``.

CUDA tensors run the compiled kernel; CPU tensors run it in Triton's interpreter (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.triton_device import kernel_for

BLOCK_N = 32  # cached tokens a program reads per tile
BLOCK_G = 16  # query rows of a tile: a KV head's group of query heads, padded for tl.dot
MAX_SPLITS = 8
_LOG2E = 1.4426950408889634


@triton.jit
def _fused_decode_kernel(q_ptr, k_ptr, v_ptr, q_row, k_row, v_row, pos_ptr, loc_ptr, cos_sin_ptr, cache_ptr,
                         indptr_ptr, indices_ptr, last_ptr, out_ptr, part_ptr, ml_ptr, count_ptr, num_splits,
                         scale_log2, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                         HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                         MAX_SPLITS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    D: tl.constexpr = 2 * HALF
    slot_row = NUM_KV_HEADS * D  # elements between two tokens of a page
    dt = cache_ptr.dtype.element_ty

    first_page = tl.load(indptr_ptr + r)
    seq = (tl.load(indptr_ptr + r + 1) - first_page - 1) * PAGE_SIZE + tl.load(last_ptr + r)
    prior = seq - 1  # tokens already in the cache
    per_split = tl.cdiv(tl.cdiv(prior, num_splits), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, prior)

    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + r).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * D + d)
    sin = tl.load(cos_sin_ptr + pos * D + HALF + d)
    gi = tl.arange(0, BLOCK_G)
    g = gi[:, None]
    g_mask = g < GROUP
    q_at = q_ptr + r * q_row + (h * GROUP + g) * D + d[None, :]
    q1 = tl.load(q_at, mask=g_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=g_mask, other=0.0).to(tl.float32)
    # Rotated q rounded to the cache dtype once, as the two-kernel path stores it.
    qr1 = (q1 * cos[None, :] - q2 * sin[None, :]).to(dt)
    qr2 = (q2 * cos[None, :] + q1 * sin[None, :]).to(dt)

    m = tl.full([BLOCK_G], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc1 = tl.zeros([BLOCK_G, HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_G, HALF], tl.float32)
    head = h * D
    n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + n
        t_mask = tok < end
        page = tl.load(indices_ptr + first_page + tok // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        k_at = cache_ptr + ((page * 2) * PAGE_SIZE + tok % PAGE_SIZE)[:, None] * slot_row + head + d[None, :]
        k1 = tl.load(k_at, mask=t_mask[:, None], other=0.0)
        k2 = tl.load(k_at + HALF, mask=t_mask[:, None], other=0.0)
        sc = (tl.dot(qr1, tl.trans(k1)) + tl.dot(qr2, tl.trans(k2))) * scale_log2
        sc = tl.where(t_mask[None, :], sc, -1.0e30)
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.where(t_mask[None, :], tl.exp2(sc - m_new[:, None]), 0.0)
        den = den * alpha + tl.sum(p, 1)
        v_at = k_at + PAGE_SIZE * slot_row
        v1 = tl.load(v_at, mask=t_mask[:, None], other=0.0)
        v2 = tl.load(v_at + HALF, mask=t_mask[:, None], other=0.0)
        pv = p.to(dt)
        acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1)
        acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2)
        m = m_new

    if s == num_splits - 1:  # this step's token: rotate and store k, store v, attend from registers
        kn_at = k_ptr + r * k_row + head + d
        kn1 = tl.load(kn_at).to(tl.float32)
        kn2 = tl.load(kn_at + HALF).to(tl.float32)
        kr1 = (kn1 * cos - kn2 * sin).to(dt)
        kr2 = (kn2 * cos + kn1 * sin).to(dt)
        vn1 = tl.load(v_ptr + r * v_row + head + d).to(dt)
        vn2 = tl.load(v_ptr + r * v_row + head + HALF + d).to(dt)
        loc = tl.load(loc_ptr + r).to(tl.int64)
        dst = cache_ptr + ((loc // PAGE_SIZE) * 2 * PAGE_SIZE + loc % PAGE_SIZE) * slot_row + head + d
        tl.store(dst, kr1)
        tl.store(dst + HALF, kr2)
        tl.store(dst + PAGE_SIZE * slot_row, vn1)
        tl.store(dst + PAGE_SIZE * slot_row + HALF, vn2)
        sc_new = (tl.sum(qr1.to(tl.float32) * kr1.to(tl.float32)[None, :], 1)
                  + tl.sum(qr2.to(tl.float32) * kr2.to(tl.float32)[None, :], 1)) * scale_log2
        m_new = tl.maximum(m, sc_new)
        alpha = tl.exp2(m - m_new)
        p_new = tl.exp2(sc_new - m_new)
        den = den * alpha + p_new
        acc1 = acc1 * alpha[:, None] + p_new[:, None] * vn1.to(tl.float32)[None, :]
        acc2 = acc2 * alpha[:, None] + p_new[:, None] * vn2.to(tl.float32)[None, :]
        m = m_new

    o_at = out_ptr + (r * (NUM_KV_HEADS * GROUP) + h * GROUP + g) * D + d[None, :]
    out_dt = out_ptr.dtype.element_ty
    if num_splits == 1:
        tl.store(o_at, (acc1 / den[:, None]).to(out_dt), mask=g_mask)
        tl.store(o_at + HALF, (acc2 / den[:, None]).to(out_dt), mask=g_mask)
    else:
        base = (r * NUM_KV_HEADS + h) * num_splits
        p_at = part_ptr + ((base + s) * GROUP_P2 + g) * D + d[None, :]
        tl.store(p_at, acc1, mask=g_mask)
        tl.store(p_at + HALF, acc2, mask=g_mask)
        ml_at = ml_ptr + ((base + s) * GROUP_P2 + gi) * 2
        tl.store(ml_at, m, mask=gi < GROUP)
        tl.store(ml_at + 1, den, mask=gi < GROUP)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        counter = count_ptr + r * NUM_KV_HEADS + h
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:  # the last split merges them all
            # Every split's partial in one load each (no loop of dependent loads): (splits, group[, HALF]).
            j = tl.arange(0, MAX_SPLITS)[:, None]
            gp = tl.arange(0, GROUP_P2)[None, :]
            sg_mask = (j < num_splits) & (gp < GROUP)
            at = (base + j) * GROUP_P2 + gp
            mj = tl.load(ml_ptr + at * 2, mask=sg_mask, other=-1.0e30, cache_modifier=".cg")
            lj = tl.load(ml_ptr + at * 2 + 1, mask=sg_mask, other=0.0, cache_modifier=".cg")
            w = tl.exp2(mj - tl.max(mj, 0)[None, :])
            total = tl.maximum(tl.sum(w * lj, 0), 1.0e-30)  # >= 1 in a real row; padding rows stay finite
            a_at = part_ptr + at[:, :, None] * D + d[None, None, :]
            a1 = tl.load(a_at, mask=sg_mask[:, :, None], other=0.0, cache_modifier=".cg")
            a2 = tl.load(a_at + HALF, mask=sg_mask[:, :, None], other=0.0, cache_modifier=".cg")
            go = tl.arange(0, GROUP_P2)[:, None]
            m_at = out_ptr + (r * (NUM_KV_HEADS * GROUP) + h * GROUP + go) * D + d[None, :]
            tl.store(m_at, (tl.sum(a1 * w[:, :, None], 0) / total[:, None]).to(out_dt), mask=go < GROUP)
            tl.store(m_at + HALF, (tl.sum(a2 * w[:, :, None], 0) / total[:, None]).to(out_dt), mask=go < GROUP)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (and graph replay)


def supports(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel serves the shape: a KV head's query group fits one 16-row tile and half
    the head dim is a power of two of at least 16 (the dots' inner size)."""
    half = head_dim // 2
    return (num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= BLOCK_G and head_dim % 2 == 0
            and half >= 16 and half & (half - 1) == 0)


def decode_splits(rows: int, num_kv_heads: int, num_sms: int) -> int:
    """KV splits of a decode shape: enough programs to cover the GPU's SMs once, at most
    :data:`MAX_SPLITS`; one (no merge) once rows x KV heads fill them."""
    return max(1, min(MAX_SPLITS, num_sms // (rows * num_kv_heads)))


class FusedDecodeAttention:
    """The kernel's scratch (split partials) and done-counters for one backend, sized for
    ``max_rows`` rows of ``num_kv_heads`` KV heads at :func:`decode_splits` of ``num_sms``."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, max_rows: int, num_sms: int,
                 device: torch.device) -> None:
        if not supports(num_q_heads, num_kv_heads, head_dim):
            raise ValueError(f"fused decode attention does not serve {num_q_heads} query heads over {num_kv_heads} "
                             f"KV heads of {head_dim}: a KV head's group must be <= {BLOCK_G} query heads and "
                             "head_dim / 2 a power of two >= 16")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.num_sms, self.max_rows = num_sms, max_rows
        self.group_p2 = triton.next_power_of_2(num_q_heads // num_kv_heads)
        # Only shapes that split write partials (one slot a row, KV head and split).
        slots = max((rows * num_kv_heads * n for rows in range(1, max_rows + 1)
                     if (n := decode_splits(rows, num_kv_heads, num_sms)) > 1), default=1)
        self.partials = torch.empty(slots * self.group_p2 * head_dim, dtype=torch.float32, device=device)
        self.max_sums = torch.empty(slots * self.group_p2 * 2, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_rows * num_kv_heads, dtype=torch.int32, device=device)

    def splits(self, rows: int) -> int:
        """The KV splits this backend's launches of ``rows`` rows use."""
        return decode_splits(rows, self.num_kv_heads, self.num_sms)

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor, cache: torch.Tensor, locations: torch.Tensor, kv_indptr: torch.Tensor,
               kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of ``rows = q.shape[0]`` decode rows; returns ``(rows, Hq, D)`` in ``q``'s dtype.

        ``q`` (rows, Hq*D), ``k`` and ``v`` (rows, Hk*D): row views of a fused QKV output with a
        contiguous last dim, not rotated (only read). ``positions``, ``locations`` (one per row),
        the paged metadata (at least ``rows + 1`` / ``rows`` entries) and the float32 cos/sin table
        as :mod:`worker.attention.rope_store` takes them. Writes this step's k (rotated) and v into
        ``cache`` (one layer). Graph-safe: one launch, no host sync; the output is allocated here.
        """
        rows = q.shape[0]
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"fused decode attention of {rows} rows; this backend serves 1 to {self.max_rows}")
        out = torch.empty((rows, self.num_q_heads, self.head_dim), dtype=q.dtype, device=q.device)
        splits = self.splits(rows)
        _, _, page_size, kv_heads, head_dim = cache.shape
        kernel_for(_fused_decode_kernel, q.device)[(rows, kv_heads, splits)](
            q, k, v, q.stride(0), k.stride(0), v.stride(0), positions, locations, cos_sin_cache, cache,
            kv_indptr, kv_indices, kv_last_page_len, out, self.partials, self.max_sums, self.counters, splits,
            scale * _LOG2E, GROUP=self.num_q_heads // kv_heads, GROUP_P2=self.group_p2, NUM_KV_HEADS=kv_heads,
            HALF=head_dim // 2, PAGE_SIZE=page_size, BLOCK_N=BLOCK_N, BLOCK_G=BLOCK_G, MAX_SPLITS=MAX_SPLITS)
        return out
