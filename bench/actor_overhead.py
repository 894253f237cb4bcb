"""Decode step time through a Ray actor group (TP=1) against the same engine in-process.

Both run the same config (full decode graphs) side by side in one run; the ratio is what the
actor hop costs: one object-store put of the step message and one ray.get of the tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from bench.common import environment, print_table, wall_times, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from cluster.group import WorkerGroup  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402


def step_times(engine: Engine, batch: int, context: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(10, engine.arch.vocab_size, (context,), generator=g).tolist(), params)
           for _ in range(batch)]
    while any(engine.requests[i].prefilling for i in ids):
        engine.step()
    times = wall_times(engine.step, repeats=repeats, warmup=5)
    for i in ids:
        engine.abort(i)
        engine.release(i)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    args = ap.parse_args()
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    batches = [int(b) for b in args.batches.split(",")]
    overrides = [f"model.path={path}", "model.dtype=bfloat16", f"scheduler.max_running_requests={max(batches)}",
                 f"graphs.decode.max_batch_size={max(batches)}", "graphs.capture=decode",
                 f"cache.num_pages={max(batches) * (args.context // 16 + 16) + 64}"]
    cfg = load_config(None, overrides)
    local = Engine(cfg)
    local_times = {b: step_times(local, b, args.context, args.repeats) for b in batches}
    local.shutdown()
    del local
    torch.cuda.empty_cache()
    ray.init(_node_ip_address="127.0.0.1", num_gpus=torch.cuda.device_count(), include_dashboard=False)
    group = WorkerGroup(cfg)
    remote = Engine(cfg, executor=group)
    rows = []
    for b in batches:
        t = step_times(remote, b, args.context, args.repeats)
        rows.append({"preset": args.preset, "batch": b, "in_process_ms": local_times[b] * 1e3,
                     "actor_ms": t * 1e3, "actor_over_in_process": t / local_times[b]})
    group.shutdown()
    ray.shutdown()
    print_table(rows, ["preset", "batch", "in_process_ms", "actor_ms", "actor_over_in_process"])
    print(f"wrote {write_results('actor_overhead', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
