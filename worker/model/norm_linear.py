"""One Triton kernel for a decode step's residual add, RMSNorm and the projection after them.

A decoder layer's unfused step launches flashinfer's fused add + RMSNorm, then the projection's
GEMM (and, for the MLP, SiLU-and-mul after gate/up): three kernels before the MLP's down
projection and two before attention. At decode batch sizes the GEMM streams the weight once and
the activations are a few KiB, so :func:`add_rms_norm_linear` recomputes the norm of each row in
every program (two passes over the row: the sum of squares, then the normed row times the weight
tile) and folds the add, the norm, the GEMM, an optional bias and an optional SiLU-and-mul into
one launch. A layer then runs six kernels (this one twice, RoPE + KV write, attention, o_proj and
down) instead of nine, five where :mod:`worker.model.norm_qkv_rope` also folds RoPE and the KV
write into the qkv one (it reuses this module's pass helpers).

The arithmetic is flashinfer's: the sum ``x + residual`` in float32, stored rounded to the
inputs' dtype as the new residual; the norm taken of the float32 sum; the normed row times the
norm weight rounded once to the dtype, then the GEMM with float32 accumulation; gate and up
rounded to the dtype before ``silu(gate) * up`` in float32 (flashinfer's ``silu_and_mul`` reads
them rounded). A GEMM of a different tiling than cuBLAS's sums in another order: results agree
to rounding, not bit for bit, so a model takes one path or the other for a whole captured shape.

For at most :data:`MAX_ROWS` rows: 2 to 16 rows ride in one 16-row tile of ``tl.dot``, which a
decode step's weight-bound GEMM pays nothing for; one row (batch 1) takes a vector product, whose
program keeps a fraction of the registers (so more of them stream the weight at once). CUDA
tensors run the compiled kernel; CPU tensors run the same kernel in Triton's interpreter (the CPU
test suite; the serving path never uses it there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.triton_device import dot_options, kernel_for

#: Most rows (tokens) one launch takes: the kernel's row tile.
MAX_ROWS = 16


def row_tile(rows: int) -> int:
    """The kernel's row tile for ``rows`` rows: 1 (a vector product) or :data:`MAX_ROWS` (``tl.dot``)."""
    return 1 if rows == 1 else MAX_ROWS


@triton.jit
def row_scale(x_ptr, r_ptr, res_ptr, M, K, x_row, r_row, eps, store_residual, HAS_RESIDUAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pass 1: each row's ``1 / rms(x + residual)`` (float32, BLOCK_M); with ``store_residual`` (one
    program's job) the sum is stored, rounded, as the new residual (rows of K, contiguous)."""
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    dtype = x_ptr.dtype.element_ty
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    store_rows = M * store_residual.to(tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = m_mask[:, None] & (rk < K)[None, :]
        h = tl.load(x_ptr + rm[:, None] * x_row + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(r_ptr + rm[:, None] * r_row + rk[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(res_ptr + rm[:, None] * K + rk[None, :], h.to(dtype),
                     mask=(rm < store_rows)[:, None] & (rk < K)[None, :])
        squares += tl.sum(h * h, axis=1)
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def normed_tile(x_ptr, r_ptr, g_ptr, M, K, x_row, r_row, k0, scale, HAS_NORM: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Pass 2's activation tile ``[BLOCK_M, BLOCK_K]`` at column ``k0``: the normed row times the norm
    weight, rounded once to the inputs' dtype (float32 in the interpreter: see DOT_FP32)."""
    rm = tl.arange(0, BLOCK_M)
    rk = k0 + tl.arange(0, BLOCK_K)
    k_mask = rk < K
    mask = (rm < M)[:, None] & k_mask[None, :]
    h = tl.load(x_ptr + rm[:, None] * x_row + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(r_ptr + rm[:, None] * r_row + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        g = tl.load(g_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        a = (h * scale[:, None] * g[None, :]).to(x_ptr.dtype.element_ty)
    else:
        a = h.to(x_ptr.dtype.element_ty)
    if DOT_FP32:  # Triton's interpreter multiplies 16-bit floats wrongly: the same values in float32
        a = a.to(tl.float32)
    return a


@triton.jit
def multiply_add(acc, a, w_ptr, rows, K, k0, row_mask, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """``acc + a @ W[rows, k0:k0 + BLOCK_K].T`` for the (N, K) contiguous weight: one row
    (``BLOCK_M == 1``, batch 1) as a vector product in float32 on the CUDA cores, which keeps few
    registers; 16 rows as a ``tl.dot`` on the tensor cores (its smallest tile)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rows[:, None] * K + rk[None, :], mask=row_mask[:, None] & (rk < K)[None, :], other=0.0)
    if BLOCK_M == 1:
        return acc + tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
    if DOT_FP32:
        w = w.to(tl.float32)
    return acc + tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count (Triton would specialize 1 and 16)
def _add_norm_linear_kernel(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, out_ptr, res_ptr, M, K, N, x_row, r_row, out_row,
                            eps, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    dtype = x_ptr.dtype.element_ty
    scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if HAS_NORM:
        scale = row_scale(x_ptr, r_ptr, res_ptr, M, K, x_row, r_row, eps, pid == 0, HAS_RESIDUAL, BLOCK_M, BLOCK_K)

    # Pass 2: the normed row times this program's BLOCK_N weight rows (and the up rows N below them).
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = normed_tile(x_ptr, r_ptr, g_ptr, M, K, x_row, r_row, k0, scale, HAS_NORM, HAS_RESIDUAL, BLOCK_M,
                        BLOCK_K, DOT_FP32)
        acc = multiply_add(acc, a, w_ptr, rn, K, k0, n_mask, BLOCK_M, BLOCK_K, DOT_PRECISION, DOT_FP32)
        if SILU_MUL:
            acc_up = multiply_add(acc_up, a, w_ptr, rn + N, K, k0, n_mask, BLOCK_M, BLOCK_K, DOT_PRECISION, DOT_FP32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rm[:, None] * out_row + rn[None, :], acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class Tiling:
    """A launch's tile sizes: ``block_n`` weight rows and ``block_k`` columns a step per program."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def tiling_for(n: int, k: int, rows: int) -> Tiling:
    """The default tiling for ``rows`` rows: 16 weight rows a program (the most programs: every
    projection here has thousands of rows, so at least 160 programs stream it), K steps of 256
    columns for the vector product and 128 for ``tl.dot``. Chosen by register use compiled for
    sm_90 (tests/kernel_compile.py's variants through ptxas: 56 registers a thread for the vector
    product and 128-210 for the dot at these sizes, none spilled, where wider tiles or deeper K
    steps spill), not yet by time: ``bench/norm_linear.py`` sweeps the tilings on a GPU."""
    return Tiling(16, max(16, min(256 if rows == 1 else 128, triton.next_power_of_2(k))))


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these rows and this weight: at most :data:`MAX_ROWS` rows, a
    floating dtype the weight shares, at least 16 inputs."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.shape[1] >= 16)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                        tiling: Tiling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual) * norm_weight), x + residual)`` in one launch.

    ``x`` (M, K) with M <= :data:`MAX_ROWS` and a contiguous last dim; ``residual`` like it, or None
    (the first layer: the sum is ``x`` itself, returned as is); ``weight`` (N, K) contiguous,
    ``bias`` (N,) or None. With ``silu_mul`` the weight stacks gate rows over up rows (2I, K) and the
    output is ``silu(gate) * up`` (M, I). Returns new tensors (the inputs are only read).
    Graph-safe: one launch, no host sync. Checks every input and names what does not fit.
    """
    if not supports(x, weight):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}: the kernel "
                         f"takes 1-{MAX_ROWS} rows of one float dtype and at least 16 inputs")
    m, k = x.shape
    if weight.shape[1] != k or norm_weight.shape != (k,):
        raise ValueError(f"x {tuple(x.shape)}, norm weight {tuple(norm_weight.shape)} and weight "
                         f"{tuple(weight.shape)} disagree on the input size")
    if silu_mul and weight.shape[0] % 2:
        raise ValueError(f"silu_mul needs gate and up rows stacked (an even row count), got {weight.shape[0]}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    if silu_mul and bias is not None:
        raise ValueError("silu_mul with a bias is not supported (no Llama-family MLP has one)")
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1) or not weight.is_contiguous():
        raise ValueError("x and residual need a contiguous last dim, the weight contiguous storage")
    tensors = [x, norm_weight, weight] + [t for t in (residual, bias) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, residual, the weights and the bias must share one device")
    return launch(x, residual, norm_weight, eps, weight, bias, silu_mul, tiling)


def launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
           weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
           tiling: Tiling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_linear` without its checks, for a caller whose inputs hold them by
    construction (a decoder layer: no Python checks per layer and step). ``norm_weight`` None: no
    norm and no residual (:func:`linear_rows`)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    t = tiling or tiling_for(n, k, m)
    extra = {"num_warps": t.num_warps, "num_stages": t.num_stages} if x.device.type == "cuda" else {}
    unused = weight  # a valid pointer for the arguments a constexpr switch leaves unread
    kernel_for(_add_norm_linear_kernel, x.device)[(triton.cdiv(n, t.block_n),)](
        x, residual if residual is not None else unused, norm_weight if norm_weight is not None else unused, weight,
        bias if bias is not None else unused, out, new_residual, m, k, n, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps, HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        BLOCK_M=row_tile(m), BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        **dot_options(x.dtype, x.device), **extra)
    return out, new_residual


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tiling: Tiling | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most :data:`MAX_ROWS` rows in the same kernel without its norm
    (a decode step's o_proj and down projection, for the bench to weigh against cuBLAS)."""
    if not supports(x, weight) or weight.shape[1] != x.shape[1] or not weight.is_contiguous() or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}: the kernel "
                         f"takes 1-{MAX_ROWS} rows of one float dtype, a contiguous weight of the same inputs")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    return launch(x, None, None, 0.0, weight, bias, False, tiling)[0]
