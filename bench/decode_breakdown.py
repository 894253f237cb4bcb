"""Where a full-graph decode step's time goes: host plan, graph replay, and the kernels inside.

For each bucket: wall time of the attention ``plan`` alone (host), of a replay alone (GPU, with
the sync), of the whole runner step (load + plan + replay + sync), the HBM floor, and from one
profiled replay the number of kernels, their summed device time and the largest kernels. The
gap between replay wall time and summed kernel time is launch/dependency overhead inside the
graph; the gap between the step and the replay is host work. ``pipelined_ms`` issues steps back
to back (host work of the next step overlapping the GPU work of this one, as a serving loop
does). Variants compare flashinfer's decode kernels (``VARIANTS``), each with the engine's other
defaults (fast plan, fused RoPE + KV write, KV split "auto"). ``--blas`` compares the BLAS library
the projections' GEMMs are captured with (``torch.backends.cuda.preferred_blas_library``: PyTorch's
default cuBLAS, or cuBLASLt, whose heuristics pick other tiles and split-K for few rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.common import copy_bandwidth, environment, print_table, write_results  # noqa: E402
from bench.decode import Setup, timed  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from graphs.backends import create_backend  # noqa: E402
from graphs.decode import DecodeGraphRunner  # noqa: E402
from worker.model_steps import ModelDecodeStep  # noqa: E402

CUDA = torch.device("cuda")
#: flashinfer decode kernels by name: what each changes in the engine's default backend.
VARIANTS = {"tensor_core_decode": {}, "cuda_core_decode": {"decode_use_tensor_cores": False},
            "fa3_decode": {"decode_kernel": "fa3"}, "fused_decode": {"fused_decode": True}}


def kernels_of_replay(fn) -> tuple[int, float, list[tuple[str, float, int]], float]:
    """(kernel count, summed kernel ms, top kernels as (name, ms, count), attention kernels' ms) of
    one call of ``fn``."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0 and "Memcpy" not in e.name:
            per_name[e.name].append(e.device_time_total / 1000)
    total = sum(sum(v) for v in per_name.values())
    count = sum(len(v) for v in per_name.values())
    top = sorted(((n[:70], sum(v), len(v)) for n, v in per_name.items()), key=lambda t: -t[1])[:8]
    return count, total, top, attention_kernel_ms(per_name)


def pipelined(fn, steps: int = 50) -> float:
    """Seconds per call of ``fn`` issued back to back, one sync at the end: the host work of step
    n+1 (plan, input copies) overlaps the GPU work of step n, as in a serving loop."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def attention_kernel_ms(per_name: dict[str, list[float]]) -> float:
    """Summed ms of the attention kernels: flashinfer's (prefill / decode kernels and the split-KV merge;
    on Hopper, fa3's paged kernel is ``PrefillWithKVCacheKernel<SparseCollective...>``) and our fused
    decode kernel (which also does RoPE and the KV write)."""
    return sum(sum(v) for n, v in per_name.items()
               if any(key in n for key in ("PrefillWithPagedKVCache", "PrefillWithKVCacheKernel",
                                           "DecodeWithPagedKVCache", "MergeStates",
                                           "merge_states", "VariableLengthMergeStates", "_fused_decode_kernel")))


def measure_preset(preset: str, batches: list[int], args, bw: float, rows: list, details: dict,
                   variant: str, page_size: int = 16, blas: str = "cublas") -> None:
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(blas)  # the GEMM kernels are chosen at capture and kept in the graphs
    try:
        _measure(preset, batches, args, bw, rows, details, variant, page_size, blas)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _measure(preset: str, batches: list[int], args, bw: float, rows: list, details: dict, variant: str,
             page_size: int, blas: str) -> None:
    setup = Setup(ensure_checkpoint(preset, Path(args.checkpoints)), max(batches), args.context, args.attention,
                  page_size)
    if variant in VARIANTS and VARIANTS[variant]:  # the engine's defaults but the decode kernel
        from worker.attention.flashinfer_backend import FlashInferBackend

        a = setup.attention
        setup.attention = FlashInferBackend(a.shape, setup.cache, a.max_num_rows, a.max_num_tokens,
                                            setup.pages_per_row, fast_decode_plan=True, fused_rope_store=True,
                                            decode_graph_split_kv="auto", **VARIANTS[variant])
    elif variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    step = ModelDecodeStep(setup.model, setup.attention, breakable=False)
    runner = DecodeGraphRunner(step, create_backend("full", CUDA), batches)
    runner.capture_all(progress=False)
    for b in batches:
        live = setup.batch(b)
        choice = runner.decide(live)
        plan_ms = timed(lambda: step.plan(live.attention, b), args.repeats) * 1e3
        runner.load(live, b)

        def replay():
            runner.backend.replay(b)

        replay_ms = timed(replay, args.repeats) * 1e3
        step_ms = timed(lambda: runner.execute(live, choice), args.repeats) * 1e3
        pipelined_ms = pipelined(lambda: runner.execute(live, choice)) * 1e3
        n, kernel_ms, top, attention_ms = kernels_of_replay(replay)
        floor_ms = setup.floor_bytes(b) / bw * 1e3
        cache = setup.cache
        kv_bytes = b * (args.context + 1) * cache.shape.bytes_per_page(torch.bfloat16) // cache.page_size
        rows.append({"preset": preset, "variant": variant, "blas": blas, "page_size": page_size, "bucket": b,
                     "plan_ms": plan_ms,
                     "replay_ms": replay_ms, "step_ms": step_ms, "pipelined_ms": pipelined_ms, "kernels": n,
                     "kernel_ms": kernel_ms, "attention_ms": attention_ms,
                     # the attention kernels' share of the copy bandwidth: the KV they must read over their time
                     "attention_bw_share": kv_bytes / (attention_ms * 1e-3) / bw if attention_ms else None,
                     "floor_ms": floor_ms, "step/floor": step_ms / floor_ms,
                     "pipelined/floor": pipelined_ms / floor_ms})
        details[f"{preset}/{variant}/{blas}/page{page_size}/{b}"] = top
    runner.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", default="tinyllama-1.1b,llama-3-8b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--attention", default="flashinfer")
    ap.add_argument("--variants", default="tensor_core_decode,cuda_core_decode",
                    help="flashinfer decode kernels: tensor_core_decode (fa2's prefill kernel, the default), "
                         "cuda_core_decode (the CUDA-core decode kernel), fa3_decode (fa3's, Hopper)")
    ap.add_argument("--page-sizes", default="16", help="KV-cache page sizes to compare (tokens)")
    ap.add_argument("--blas", default="cublas", help="BLAS libraries to capture the GEMMs with: cublas (PyTorch's "
                                                     "default), cublaslt")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth()
    rows, details = [], {}
    for preset in args.presets.split(","):
        for variant in args.variants.split(","):
            for page_size in (int(p) for p in args.page_sizes.split(",")):
                for blas in args.blas.split(","):
                    measure_preset(preset, batches, args, bw, rows, details, variant, page_size, blas)
                    torch.cuda.empty_cache()
    print_table(rows, ["preset", "variant", "blas", "page_size", "bucket", "plan_ms", "replay_ms", "step_ms",
                       "pipelined_ms", "kernels", "kernel_ms", "attention_ms", "attention_bw_share", "floor_ms",
                       "step/floor", "pipelined/floor"])
    for key, top in details.items():
        print(f"\n{key}: top kernels (ms, count)")
        for name, ms, count in top:
            print(f"  {ms:8.3f} {count:5d}  {name}")
    write_results("decode-breakdown", {"env": environment(), "copy_bandwidth_Bps": bw, "rows": rows,
                                       "top_kernels": details, "args": vars(args)})


if __name__ == "__main__":
    main()
