"""The fused add + RMSNorm + projection kernel against the three it replaces, per decode shape.

For each preset's two fused projections (qkv; gate/up with SiLU-and-mul) and each row count:
``unfused`` is what a decoder layer runs without ``model.norm_linear_rows``: flashinfer's fused add
+ RMSNorm, cuBLAS's GEMM (``F.linear``) and, for gate/up, flashinfer's SiLU-and-mul; ``fused`` is
:func:`worker.model.norm_linear.launch` with its default tiling, and ``best`` the fastest of a
sweep of tilings (block_n x block_k x warps x stages). The layer's two plain projections (o_proj,
down) are rows too: ``unfused`` is cuBLAS, ``fused`` the same kernel without its norm
(:func:`worker.model.norm_linear.linear_rows`), which says whether they would gain from it. And
``qkv_rope``: the qkv kernel with RoPE and the KV write folded in
(:mod:`worker.model.norm_qkv_rope`) against norm + cuBLAS + the fused RoPE store (``unfused``) and
against the qkv kernel + the RoPE store (``best``'s column holds that: two kernels).
Each is timed inside a CUDA graph of ``--calls`` back-to-back calls, as a decode graph runs them
(launch gaps in, host out): per-call time is the replay's CUDA-event time over the calls, median
of ``--repeats`` replays. The calls cycle through copies of the weight, ``--weight-mib`` of them in
all, as a model's layers do: one weight called over and over stays in the L2 cache (50 MiB on an
H100), which every tinyllama projection fits, and reads faster than HBM can give a decode step
(``--weight-mib 0``: one weight, the L2-resident time). ``GB/s`` is the weight's bytes over the
time, beside the device-to-device copy bandwidth measured in the same run; ``fused_over_unfused``
below 1: the fused kernel is faster.

GPU only: ``PYTHONPATH=/tmp/site:. python3 bench/norm_linear.py`` (``--quick``: no sweep). Prints
a table and writes ``bench/results/norm_linear-*.json``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import copy_bandwidth, cuda_times, environment, print_table, write_results  # noqa: E402
from worker.model.norm_linear import MAX_ROWS, Tiling, launch, linear_rows, tiling_for  # noqa: E402

CUDA = torch.device("cuda")
#: (hidden, qkv rows, intermediate) of each preset's layer, unsharded (q_size = hidden in both).
SHAPES = {"tinyllama-1.1b": (2048, 2048 + 2 * 256, 5632), "llama-3-8b": (4096, 4096 + 2 * 1024, 14336)}
#: (q heads, KV heads, head_dim) of each preset.
HEADS = {"tinyllama-1.1b": (32, 4, 64), "llama-3-8b": (32, 8, 128)}
SWEEP = [Tiling(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (64, 128, 256, 512), (4, 8), (3, 4))]


def graph_seconds(fn, calls: int, repeats: int) -> float:
    """Seconds per ``fn`` call, replayed ``calls`` at a time from one CUDA graph."""
    fn()  # compile / load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    seconds = statistics.median(cuda_times(graph.replay, repeats))
    del graph
    return seconds / calls


def weight_copies(rows_out: int, hidden: int, args, g: torch.Generator) -> list[torch.Tensor]:
    """Copies of one (rows_out, hidden) bf16 weight, ``args.weight_mib`` MiB in all (at least one),
    so the timed calls read their weights from HBM as a model's layers do, not from L2."""
    one = rows_out * hidden * 2
    n = max(1, -(-args.weight_mib * 2**20 // one))
    base = (torch.randn(rows_out, hidden, device=CUDA, generator=g) / hidden ** 0.5).bfloat16()
    return [base] + [base.clone() for _ in range(n - 1)]


def calls_for(copies: int, args) -> int:
    """``--calls`` rounded up to a whole number of rounds over the copies (each read equally)."""
    return -(-args.calls // copies) * copies


def bench_shape(hidden: int, rows_out: int, silu: bool, rows: int, args, norm: bool = True) -> dict:
    """One projection of ``hidden`` inputs and ``rows_out`` outputs at ``rows`` rows; ``norm``
    False: a plain projection (cuBLAS against :func:`linear_rows`)."""
    from flashinfer.activation import silu_and_mul
    from flashinfer.norm import fused_add_rmsnorm

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device=CUDA, generator=g).bfloat16()
    residual = torch.randn(rows, hidden, device=CUDA, generator=g).bfloat16()
    norm_w = torch.ones(hidden, device=CUDA, dtype=torch.bfloat16)
    ws = weight_copies(2 * rows_out if silu else rows_out, hidden, args, g)
    weight = itertools.cycle(ws).__next__
    calls = calls_for(len(ws), args)
    hx, hr = x.clone(), residual.clone()

    def unfused():
        if norm:
            fused_add_rmsnorm(hx, hr, norm_w, 1e-5)  # in place, as the layer's
        y = F.linear(hx, weight())
        return silu_and_mul(y) if silu else y

    def fused(tiling=None):
        if not norm:
            return linear_rows(x, weight(), None, tiling)
        return launch(x, residual, norm_w, 1e-5, weight(), None, silu, tiling)

    row = {"rows": rows, "hidden": hidden, "out": rows_out, "silu": silu, "norm": norm,
           "weight_bytes": ws[0].numel() * ws[0].element_size(), "weight_copies": len(ws)}
    row["unfused_us"] = graph_seconds(unfused, calls, args.repeats) * 1e6
    row["fused_us"] = graph_seconds(fused, calls, args.repeats) * 1e6
    row["default_tiling"] = vars_of(tiling_for(rows_out, hidden, rows))
    if not args.quick and rows in args.sweep_rows_list:
        times = {}
        for t in SWEEP:
            try:
                times[t] = graph_seconds(lambda t=t: fused(t), calls, args.repeats) * 1e6
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile (shared memory) is skipped
                row.setdefault("sweep_errors", {})[str(vars_of(t))] = f"{type(e).__name__}: {str(e)[:120]}"
        if times:
            best = min(times, key=times.get)
            row["best_us"], row["best_tiling"] = times[best], vars_of(best)
    for name in ("unfused", "fused", "best"):
        if f"{name}_us" in row:
            row[f"{name}_GBps"] = row["weight_bytes"] / row[f"{name}_us"] / 1e3
    row["fused_over_unfused"] = row["fused_us"] / row["unfused_us"]
    if "best_us" in row:
        row["best_over_unfused"] = row["best_us"] / row["unfused_us"]
    return row


def bench_qkv_rope(preset: str, rows: int, args) -> dict:
    """norm + qkv + RoPE + KV write: three kernels (flashinfer's norm, cuBLAS, the fused RoPE store),
    two (the norm-linear qkv kernel, the RoPE store) and one (:mod:`worker.model.norm_qkv_rope`)."""
    from flashinfer.norm import fused_add_rmsnorm

    from worker.attention.rope_store import launch as rope_store
    from worker.model import norm_qkv_rope
    from worker.model.rotary import cos_sin_cache

    hidden, qkv_rows, _ = SHAPES[preset]
    q_heads, kv_heads, head_dim = HEADS[preset]
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device=CUDA, generator=g).bfloat16()
    residual = torch.randn(rows, hidden, device=CUDA, generator=g).bfloat16()
    norm_w = torch.ones(hidden, device=CUDA, dtype=torch.bfloat16)
    ws = weight_copies(qkv_rows, hidden, args, g)
    weight = itertools.cycle(ws).__next__
    calls = calls_for(len(ws), args)
    cache = torch.zeros(rows + 2, 2, 16, kv_heads, head_dim, device=CUDA, dtype=torch.bfloat16)
    positions = torch.arange(rows, device=CUDA) + 500
    locations = torch.arange(rows, device=CUDA) * 16 + 3
    table = cos_sin_cache(head_dim, 10000.0, None, 4096, CUDA)
    hx, hr = x.clone(), residual.clone()
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim

    def store(qkv):
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        rope_store(q, k, v, positions, table, cache, locations)

    def unfused():
        fused_add_rmsnorm(hx, hr, norm_w, 1e-5)
        store(F.linear(hx, weight()))

    def two():
        store(launch(x, residual, norm_w, 1e-5, weight())[0])

    def one():
        norm_qkv_rope.launch(x, residual, norm_w, 1e-5, weight(), None, q_heads, positions, table, cache, locations)

    row = {"rows": rows, "hidden": hidden, "out": qkv_rows, "silu": False, "norm": True,
           "weight_bytes": ws[0].numel() * ws[0].element_size(), "weight_copies": len(ws)}
    for name, fn in (("unfused", unfused), ("best", two), ("fused", one)):
        row[f"{name}_us"] = graph_seconds(fn, calls, args.repeats) * 1e6
        row[f"{name}_GBps"] = row["weight_bytes"] / row[f"{name}_us"] / 1e3
    row["fused_over_unfused"] = row["fused_us"] / row["unfused_us"]
    row["best_over_unfused"] = row["best_us"] / row["unfused_us"]
    return row


def vars_of(t: Tiling) -> dict:
    return {"block_n": t.block_n, "block_k": t.block_k, "num_warps": t.num_warps, "num_stages": t.num_stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--calls", type=int, default=50, help="calls captured in one graph")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--weight-mib", type=int, default=256,
                    help="the weight copies the calls cycle through, in MiB (0: one weight, read from L2)")
    ap.add_argument("--quick", action="store_true", help="default tiling only (no sweep)")
    ap.add_argument("--sweep-rows", default="1,16", help="row counts whose tilings are swept (each row tile's)")
    args = ap.parse_args()
    args.sweep_rows_list = [int(r) for r in args.sweep_rows.split(",") if r]
    rows_list = [int(r) for r in args.rows.split(",") if r]
    if any(not 0 < r <= MAX_ROWS for r in rows_list):
        ap.error(f"--rows must each be 1-{MAX_ROWS}")
    bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    table = []
    presets = args.presets.split(",")
    for i, preset in enumerate(presets):
        if i:  # what the presets before gave survives a crash or the run's timeout
            write_results("norm_linear-partial", {"env": environment(), "copy_bandwidth_Bps": bw, "args": vars(args),
                                                  "rows": table})
        if preset not in SHAPES:
            ap.error(f"unknown preset {preset!r}: one of {', '.join(SHAPES)}")
        hidden, qkv, inter = SHAPES[preset]
        projections = (("qkv", hidden, qkv, False, True), ("gate_up", hidden, inter, True, True),
                       ("o_proj", hidden, hidden, False, False), ("down", inter, hidden, False, False))
        for (proj, k, out, silu, norm), rows in itertools.product(projections, rows_list):
            r = {"preset": preset, "projection": proj, **bench_shape(k, out, silu, rows, args, norm)}
            r["copy_GBps"] = bw / 1e9
            table.append(r)
            print(f"{preset} {proj} rows {rows}: unfused {r['unfused_us']:.1f} us, fused {r['fused_us']:.1f} us, "
                  f"best {r.get('best_us', float('nan')):.1f} us {r.get('best_tiling', '')}", flush=True)
        for rows in rows_list:
            r = {"preset": preset, "projection": "qkv_rope", **bench_qkv_rope(preset, rows, args),
                 "copy_GBps": bw / 1e9}
            table.append(r)
            print(f"{preset} qkv_rope rows {rows}: three kernels {r['unfused_us']:.1f} us, two {r['best_us']:.1f} us, "
                  f"one {r['fused_us']:.1f} us", flush=True)
    print_table(table, ["preset", "projection", "rows", "unfused_us", "fused_us", "best_us", "fused_over_unfused",
                        "best_over_unfused", "unfused_GBps", "fused_GBps", "best_GBps"])
    results = {"env": environment(), "copy_bandwidth_Bps": bw, "args": vars(args), "rows": table}
    print(f"wrote {write_results('norm_linear', results)}")


if __name__ == "__main__":
    main()
