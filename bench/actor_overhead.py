"""Decode step time through a Ray actor group (TP=1) against the same engine in-process.

Both run the same config (full decode graphs on a GPU) side by side in one run; the ratio is
what the actor hop costs. Two ways to drive the group are measured: a Ray Compiled Graph
(``cluster.compiled_graph=true``, the default: shared-memory channels) and a Ray task per rank
per step (an object-store put of the message and a ray.get of the tokens). Without a GPU it runs
the same comparison on the CPU (graphs off) with ``--preset tiny-llama``: the hop cost is host work.
``async_compiled_ms`` is the compiled graph with ``scheduler.async_scheduling`` (step N+1 sent
before step N is read back: the hop overlaps the rank's compute).
Each step is split into the rank's own ``Worker.execute`` and the hop around it; ``bare_channel_ms``
is Ray's channel alone for that hop: the same message to an actor that only spins as long as the
rank took (the reader's wake-up grows with the wait: 51 us at 0 ms, 329 us at 10 ms on the 2-core
CPU machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from bench.common import decode_step_breakdown, environment, print_table, wall_times, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from cluster.group import WorkerGroup  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402
from worker.step_message import StepMessage, StepResult  # noqa: E402


@ray.remote(num_cpus=1)
class _Echo:
    """A rank that only spins for ``work_s`` (as a rank waits on its device): what the
    compiled-graph channel alone costs a step that long."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s

    def execute(self, msg: StepMessage) -> StepResult:
        end = time.perf_counter() + self.work_s
        while time.perf_counter() < end:
            pass
        return StepResult([0] * len(msg.logits_rows))


def bare_channel_seconds(batch: int, context: int, work_s: float, repeats: int) -> float:
    """Median round trip, less ``work_s``, of a decode-shaped StepMessage (``batch`` rows of
    ``context`` tokens, one SamplingParams each) through a Ray Compiled Graph to an actor that
    spins ``work_s`` and returns."""
    from ray.dag import InputNode, MultiOutputNode

    pages = context // 16 + 1
    msg = StepMessage(False, list(range(batch)), [context] * batch, [context + 1] * batch, [1] * batch,
                      [list(range(i * pages, (i + 1) * pages)) for i in range(batch)], list(range(batch)),
                      [SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True) for _ in range(batch)],
                      list(range(batch)), [1] * batch)
    echo = _Echo.remote(work_s)
    with InputNode() as inp:
        dag = MultiOutputNode([echo.execute.bind(inp)]).experimental_compile()
    try:
        return statistics.median(wall_times(lambda: ray.get(dag.execute(msg)), repeats=repeats, warmup=20)) - work_s
    finally:
        dag.teardown()
        ray.kill(echo)


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
    for way, extra in (("compiled", ["cluster.compiled_graph=true", "scheduler.async_scheduling=false"]),
                       ("tasks", ["cluster.compiled_graph=false", "scheduler.async_scheduling=false"]),
                       ("async", ["cluster.compiled_graph=true", "scheduler.async_scheduling=true"])):
        group_cfg = load_config(None, [*overrides, *extra])
        group = WorkerGroup(group_cfg)
        remote = Engine(group_cfg, executor=group)
        actor_times[way] = {b: decode_step_breakdown(remote, b, args.context, args.repeats) for b in batches}
        group.shutdown()
    channel = {b: bare_channel_seconds(b, args.context, actor_times["compiled"][b]["rank_s"], max(args.repeats, 200))
               for b in batches}
    ray.shutdown()
    rows = []
    for b in batches:
        loc, cg, tasks, pipe = (local_times[b], actor_times["compiled"][b], actor_times["tasks"][b],
                                actor_times["async"][b])
        rows.append({
            "preset": args.preset, "batch": b, "in_process_ms": loc["step_s"] * 1e3,
            "compiled_graph_ms": cg["step_s"] * 1e3, "ray_tasks_ms": tasks["step_s"] * 1e3,
            "async_compiled_ms": pipe["step_s"] * 1e3,
            "compiled_over_in_process": cg["step_s"] / loc["step_s"],
            "async_over_in_process": pipe["step_s"] / loc["step_s"],
            "tasks_over_in_process": tasks["step_s"] / loc["step_s"],
            # where the difference goes: the rank's own execute, and the hop around it
            "rank_in_process_ms": loc["rank_s"] * 1e3, "rank_compiled_ms": cg["rank_s"] * 1e3,
            "rank_async_ms": pipe["rank_s"] * 1e3,
            "hop_compiled_ms": (cg["execute_s"] - cg["rank_s"]) * 1e3,
            "hop_tasks_ms": (tasks["execute_s"] - tasks["rank_s"]) * 1e3,
            # of which Ray's channel: the same message to an actor that spins as long as the rank took
            "bare_channel_ms": channel[b] * 1e3})
    print_table(rows, list(rows[0]))
    print(f"wrote {write_results('actor_overhead', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
