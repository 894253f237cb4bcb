"""Capture cost and memory of prefill graphs (GPU).

1. Build time of the default ~40-shape prefill ladder up to the chunked-prefill size, per
   backend (breakable, full, tc_piecewise). tc_piecewise's build is two costs, reported apart:
   ``compile_s`` (torch.compile: dynamo trace, split, inductor; once for every shape) and
   ``capture_s`` (warm-up and piecewise capture of every shape).
2. Memory above the model, against the no-graph (eager) baseline, with prefill graphs captured
   up to 1/4, 1/2 and 1x the chunk, then one prefill of exactly the chunk size: below 1x the
   largest chunk still runs eagerly and keeps its activation peak; at 1x it replays inside graph
   memory. ``peak``: the most the allocator reserved from before capture to after the prefill
   (what the KV cache must leave room for); ``held``: what it still reserves after the prefill
   (what a serving process keeps); ``pool``: the graph pool's share of that.
3. Warm-ups inside the graph pool (``graphs.warm_up_in_pool``, the default) beside warm-ups
   outside it, for breakable and full at the chunk size.
   Each configuration runs in a fresh process (peaks are per process).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402


def one(path: Path, chunk: int, ceiling: int | None, backend: str, warm_up_in_pool: bool = True) -> dict:
    """In this process: load, capture (unless ceiling is None), run one chunk-sized prefill."""
    from graphs.backends import create_backend
    from graphs.prefill import PrefillGraphRunner, default_prefill_ladder
    from graphs.process import pool_bytes
    from worker.attention.base import AttentionBatch
    from worker.attention.factory import create_attention_backend
    from worker.kv_cache import KVCacheShape, PagedKVCache
    from worker.model.kernels import select_kernels
    from worker.model.loader import load_model
    from worker.model_steps import CompiledPrefillStep, ModelPrefillStep

    cuda = torch.device("cuda")
    model, arch = load_model(path, torch.bfloat16, cuda, kernels=select_kernels(cuda))
    pages = chunk // 16 + 2 + 8  # + per-request page rounding
    shape = model.attention_shape
    cache = PagedKVCache(KVCacheShape(arch.num_layers, pages, 16, shape.num_kv_heads, arch.head_dim),
                         torch.bfloat16, cuda)
    attention = create_attention_backend("flashinfer", shape, cache, max(1, chunk // 512), chunk, pages)
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    build = compile_s = capture_s = None
    runner = None
    if ceiling is not None:
        step = CompiledPrefillStep(model, attention) if backend == "tc_piecewise" else \
            ModelPrefillStep(model, attention, breakable=backend == "breakable")
        runner = PrefillGraphRunner(step, create_backend(backend, cuda, warm_up_in_pool=warm_up_in_pool),
                                    default_prefill_ladder(ceiling),
                                    max(1, chunk // 512), 2.0, None, torch.bfloat16)
        start = time.perf_counter()
        runner.capture_all(progress=False)
        build = time.perf_counter() - start
        if backend == "tc_piecewise":
            stats = runner.backend.stats()
            compile_s, capture_s = stats["compile_seconds"], stats["capture_seconds"]
        else:
            compile_s, capture_s = 0.0, build
    torch.cuda.reset_peak_memory_stats()
    from graphs.prefill import LivePrefillBatch

    # A chunk of exactly ``chunk`` tokens, split into requests no longer than the model's
    # positions (tinyllama-1.1b has 2048: one 8192-token request would index past its RoPE table).
    n_req = -(-chunk // arch.max_position_embeddings)
    lengths = [chunk // n_req + (i < chunk % n_req) for i in range(n_req)]
    tables, first = [], 1
    for n in lengths:
        tables.append(list(range(first, first + -(-n // 16))))
        first += -(-n // 16)
    ids = torch.randint(10, arch.vocab_size, (chunk,), device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    live = LivePrefillBatch(ids, pos, AttentionBatch.prefill(lengths, lengths, tables), n_req)
    choice = runner.decide(live) if runner is not None else None
    if choice is not None and choice.replays:
        runner.execute(live, choice)
        mode = "graph"
    else:
        attention.plan(live.attention)
        model(ids, pos, attention)
        mode = "eager"
    torch.cuda.synchronize()
    return {"backend": backend, "ceiling": ceiling, "mode": mode,
            "warm_up": ("pool" if warm_up_in_pool else "outside") if runner else None,
            "build_s": build, "compile_s": compile_s,
            "capture_s": capture_s, "failed": len(runner.failed) if runner else 0,
            "shapes": len(runner.ladder) if runner else 0,
            "above_baseline_bytes": torch.cuda.max_memory_reserved() - base,
            "held_bytes": torch.cuda.memory_reserved() - base,
            "pool_bytes": pool_bytes(runner.backend.pool) if runner else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--only", help="comma-separated configurations backend:ceiling:warm_up (e.g. "
                    "none:none:-,full:8192:pool); default: all")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    if args.one:
        backend, ceiling, warm_up = args.one.split(":")
        print(json.dumps(one(path, args.chunk, None if ceiling == "none" else int(ceiling), backend,
                             warm_up == "pool")))
        return
    # One process per configuration also isolates tc_piecewise's torch.compile state (process-wide).
    chunk = str(args.chunk)
    runs = [("none", "none", "-")] + [(b, chunk, "pool") for b in ("breakable", "full", "tc_piecewise")] + \
        [(b, chunk, "outside") for b in ("breakable", "full")] + \
        [("breakable", str(args.chunk * f // 4), "pool") for f in (1, 2)]
    if args.only:
        runs = [tuple(c.split(":")) for c in args.only.split(",")]
    rows = []
    for backend, ceiling, warm_up in runs:
        res = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--chunk", chunk,
                              "--checkpoints", args.checkpoints, "--one", f"{backend}:{ceiling}:{warm_up}"],
                             capture_output=True, text=True, timeout=900, check=False)
        lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else {"backend": backend, "ceiling": ceiling, "warm_up": warm_up,
                                                           "error": res.stderr[-2000:]})
    baseline = next((r.get("above_baseline_bytes") for r in rows if r.get("backend") == "none"), None)
    for r in rows:
        if "error" in r:
            print(f"{r['backend']}:{r['ceiling']}:{r['warm_up']} failed: {r['error']}")
    for r in rows:
        if "above_baseline_bytes" in r:
            r["peak_GiB"] = r["above_baseline_bytes"] / 2**30
            r["held_GiB"] = r["held_bytes"] / 2**30
            r["pool_GiB"] = r["pool_bytes"] / 2**30
            r["vs_no_graph"] = r["above_baseline_bytes"] / baseline if baseline else None
            r["held_vs_no_graph"] = r["held_bytes"] / baseline if baseline else None
    print("peak and held: GiB the allocator reserves above the model (peak from before capture to after a "
          f"chunk-size prefill; held after it); vs_no_graph over the eager peak ({(baseline or 0) / 2**30:.3f} GiB)")
    print_table(rows, ["backend", "ceiling", "warm_up", "mode", "shapes", "failed", "build_s", "compile_s",
                       "capture_s", "peak_GiB", "held_GiB", "pool_GiB", "vs_no_graph", "held_vs_no_graph"])
    print(f"wrote {write_results('capture', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
