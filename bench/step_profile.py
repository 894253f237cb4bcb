"""Where an engine decode step's time goes, per sampling variant: device kernels against host work.

One engine (decode graphs on, the default config otherwise); for each variant of
``bench/logprobs.py`` (none, logprobs, top 20, penalties) B requests are prefilled and ``--repeats``
whole engine steps run under ``torch.profiler`` (CPU and CUDA). Per variant it prints the wall time
per step, the summed device time of the kernels per step (what the GPU does; with async scheduling a
step costs the larger of that and the host's work), the CPU-side torch ops by self time per step, and
the largest kernels, and (from a cProfile run of the same steps) the Python functions by own time.
Usage (GPU machine): ``python bench/step_profile.py [--preset ...] [--batch 64]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.common import environment, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from bench.logprobs import VARIANTS  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402

#: Functions whose cumulative time per step (under cProfile) is printed for every variant.
WATCHED = ("worker/step_pipeline.py:_send", "worker/step_pipeline.py:_read_back", "worker/model_runner.py:execute",
           "worker/sampling/sampler.py:sample", "worker/sampling/logprobs.py:logprobs_of",
           "worker/sampling/logprob_graphs.py:__call__", "worker/readback.py:copy", "worker/readback.py:wait",
           "worker/readback.py:sample_lists", "worker/output_processor.py:append_tokens",
           "worker/scheduler.py:schedule")


def profiled_steps(engine: Engine, batch: int, context: int, repeats: int, g: torch.Generator,
                   fields: dict) -> dict:
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True, **fields)
    ids = [engine.add_request(torch.randint(10, engine.arch.vocab_size, (context,), generator=g).tolist(), params)
           for _ in range(batch)]
    while any(engine.requests[i].prefilling for i in ids):
        engine.step()
    for _ in range(5):
        engine.step()
    py = cProfile.Profile()
    py.enable()
    for _ in range(repeats):
        engine.step()
    py.disable()
    host = io.StringIO()
    stats = pstats.Stats(py, stream=host)
    stats.sort_stats("tottime").print_stats(18)
    watched = {}
    for (filename, _, function), (_, _, _, cumulative, _) in stats.stats.items():
        for name in WATCHED:
            module, _, fn = name.rpartition(":")
            if function == fn and filename.endswith(module):
                watched[name] = watched.get(name, 0.0) + cumulative * 1e3 / repeats
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    for i in ids:
        engine.abort(i)
        engine.release(i)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    cpu_ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key][0] += e.self_device_time_total / 1e3
            kernels[e.key][1] += e.count
        else:
            cpu_ops[e.key][0] += e.self_cpu_time_total / 1e3
            cpu_ops[e.key][1] += e.count
    per = 1.0 / repeats
    return {"python_tottime": host.getvalue(), "watched_ms": watched, "wall_ms": statistics.median(walls) * 1e3,
            "device_ms": sum(v[0] for v in kernels.values()) * per,
            "kernels_per_step": sum(v[1] for v in kernels.values()) * per,
            "top_kernels": sorted(((k, v[0] * per, v[1] * per) for k, v in kernels.items()), key=lambda x: -x[1])[:12],
            "top_cpu_ops": sorted(((k, v[0] * per, v[1] * per) for k, v in cpu_ops.items()), key=lambda x: -x[1])[:20]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="none,logprobs,top20")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    args = ap.parse_args()
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    pages = args.batch * (-(-(args.context + 64 * (args.repeats + 8)) // 16)) + 64
    engine = Engine(load_config(None, [f"model.path={path}", "model.dtype=bfloat16", f"cache.num_pages={pages}",
                                       f"scheduler.max_running_requests={args.batch}"]))
    g = torch.Generator().manual_seed(0)
    results = {}
    for name in args.variants.split(","):
        r = results[name] = profiled_steps(engine, args.batch, args.context, args.repeats, g, VARIANTS[name])
        print(f"\n== {name}: wall {r['wall_ms']:.3f} ms/step, device {r['device_ms']:.3f} ms/step, "
              f"{r['kernels_per_step']:.1f} kernels/step")
        print("  kernels (ms/step, count/step):")
        for k, ms, n in r["top_kernels"]:
            print(f"    {ms:8.4f} {n:5.1f}  {k[:110]}")
        print("  CPU ops by self time (ms/step, count/step):")
        for k, ms, n in r["top_cpu_ops"]:
            print(f"    {ms:8.4f} {n:5.1f}  {k[:110]}")
        print("  watched functions, cumulative ms per step (cProfile, a separate run):")
        for name, ms in sorted(r["watched_ms"].items()):
            print(f"    {ms:8.4f}  {name}")
        print(f"  Python functions by own time over {args.repeats} steps (cProfile, a separate run):")
        print("\n".join(line for line in r["python_tottime"].splitlines()[6:] if line.strip()))
    out = write_results("step_profile", {"env": environment(), "args": vars(args), "variants": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
