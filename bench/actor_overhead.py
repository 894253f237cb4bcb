"""Decode step time through a Ray actor group (TP=1) against the same engine in-process.

Both run the same config (full decode graphs on a GPU) side by side in one run; the ratio is
what the actor hop costs. Two ways to drive the group are measured: a Ray Compiled Graph
(``cluster.compiled_graph=true``, the default: shared-memory channels) and a Ray task per rank
per step (an object-store put of the message and a ray.get of the tokens). Without a GPU it runs
the same comparison on the CPU (graphs off) with ``--preset tiny-llama``: the hop cost is host work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from bench.common import decode_step_breakdown, environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from cluster.group import WorkerGroup  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker.engine import Engine  # noqa: E402


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
    cuda = torch.cuda.is_available()
    overrides = [f"model.path={path}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
                 f"model.device={'cuda' if cuda else 'cpu'}", f"scheduler.max_running_requests={max(batches)}",
                 f"graphs.decode.max_batch_size={max(batches)}", "graphs.capture=decode",
                 f"cache.num_pages={max(batches) * (args.context // 16 + 16) + 64}"]
    cfg = load_config(None, overrides)
    local = Engine(cfg)
    local_times = {b: decode_step_breakdown(local, b, args.context, args.repeats) for b in batches}
    local.shutdown()
    del local
    if cuda:
        torch.cuda.empty_cache()
    ray.init(_node_ip_address="127.0.0.1", num_gpus=torch.cuda.device_count(), include_dashboard=False)
    actor_times = {}
    for compiled in (True, False):
        group_cfg = load_config(None, [*overrides, f"cluster.compiled_graph={str(compiled).lower()}"])
        group = WorkerGroup(group_cfg)
        remote = Engine(group_cfg, executor=group)
        actor_times[compiled] = {b: decode_step_breakdown(remote, b, args.context, args.repeats) for b in batches}
        group.shutdown()
    ray.shutdown()
    rows = []
    for b in batches:
        loc, cg, tasks = local_times[b], actor_times[True][b], actor_times[False][b]
        rows.append({
            "preset": args.preset, "batch": b, "in_process_ms": loc["step_s"] * 1e3,
            "compiled_graph_ms": cg["step_s"] * 1e3, "ray_tasks_ms": tasks["step_s"] * 1e3,
            "compiled_over_in_process": cg["step_s"] / loc["step_s"],
            "tasks_over_in_process": tasks["step_s"] / loc["step_s"],
            # where the difference goes: the rank's own execute, and the hop around it
            "rank_in_process_ms": loc["rank_s"] * 1e3, "rank_compiled_ms": cg["rank_s"] * 1e3,
            "hop_compiled_ms": (cg["execute_s"] - cg["rank_s"]) * 1e3,
            "hop_tasks_ms": (tasks["execute_s"] - tasks["rank_s"]) * 1e3})
    print_table(rows, list(rows[0]))
    print(f"wrote {write_results('actor_overhead', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
