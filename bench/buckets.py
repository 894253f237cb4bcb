"""Profile-guided ladders against the default ladders at equal graph memory (GPU).

Each ladder runs in its own process (its own graph pool, so pool growth is its graph memory).

1. Replay the skewed synthetic trace (``worker.traces.skewed_trace``, fixed seed) through an
   engine with the default ladders; record its batch-shape profile.
2. Start a second engine with ``graphs.profile`` set and no explicit budget: the planner
   reshapes both ladders within the memory the default ladders take.
3. Replay the same trace through both (after a warm-up pass of it); report padded tokens
   (prefill) and padded rows (decode) under each ladder from the recorded histograms, graph
   memory, and the total step time measured in the same run (sum of engine step durations).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.common import environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from deploy.config import load_config  # noqa: E402
from graphs.planner import expected_padded_rows, expected_padded_tokens  # noqa: E402
from graphs.profile import BatchProfile  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.traces import run_trace, skewed_trace  # noqa: E402


def run(cfg, trace, seed: int) -> tuple[Engine, float]:
    engine = Engine(cfg)
    # Warm-up: the whole trace once (other prompt tokens), so every shape the measured pass hits has
    # been replayed before (a graph's first launch uploads it) and the JIT and allocator are warm.
    run_trace(engine, trace, seed=seed + 1)
    engine.step_stats.clear()
    run_trace(engine, trace, seed=seed)
    return engine, sum(s.duration_s for s in engine.step_stats)


def run_one(args, ladder: str, out: str) -> None:
    """One side in this process: replay the trace, write its ladders, graph bytes and step time."""
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    overrides = [f"model.path={path}", "model.dtype=bfloat16", "scheduler.max_running_requests=128",
                 "graphs.decode.max_batch_size=128", "scheduler.chunked_prefill_size=2048",
                 "graphs.prefill.max_tokens=2048", "cache.num_pages=20000"]
    profile_path = Path(out).with_name("default-profile.json")
    if ladder == "guided":
        overrides.append(f"graphs.profile={profile_path}")
    trace = skewed_trace(args.requests, seed=args.seed)
    engine, step_s = run(load_config(None, overrides), trace, args.seed)
    w = engine.worker
    if ladder == "default":
        w.profile().save(str(profile_path))
    side = {"decode": list(w.runner.decode_runner.ladder), "prefill": list(w.runner.prefill_runner.ladder),
            "bytes": w.runner.decode_runner.backend.resident_bytes + w.runner.prefill_runner.backend.resident_bytes,
            "slots": w.runner.prefill_runner.slots, "ratio": w.runner.prefill_runner.max_padding_ratio,
            "budget_notes": list(w.budget_report.notes) if w.budget_report is not None else [],
            "step_s": step_s}
    engine.shutdown()
    Path(out).write_text(json.dumps(side))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--one", nargs=2, metavar=("LADDER", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return run_one(args, *args.one)
    # Each ladder runs in its own process: a process keeps its graph pool's freed blocks, so a
    # second engine in the same process would capture into them and measure no pool growth.
    work = Path(tempfile.mkdtemp(prefix="buckets-"))
    sides = {}
    for ladder in ("default", "guided"):
        out = work / f"{ladder}.json"
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", ladder, str(out)], check=True)
        sides[ladder] = json.loads(out.read_text())
    default, guided = sides["default"], sides["guided"]
    profile = BatchProfile.load(work / "default-profile.json")
    default_time, guided_time = default.pop("step_s"), guided.pop("step_s")
    rows = []
    for name, lad, t in (("default", default, default_time), ("profile-guided", guided, guided_time)):
        rows.append({
            "ladder": name, "decode_shapes": len(lad["decode"]), "prefill_shapes": len(lad["prefill"]),
            "graph_MiB": lad["bytes"] / 2**20,
            "padded_prefill_tokens": expected_padded_tokens(profile.prefill, lad["prefill"], default["slots"],
                                                            default["ratio"]),
            "padded_decode_rows": expected_padded_rows(profile.decode, lad["decode"]),
            "total_step_s": t})
    base, new = rows
    summary = {"padded_prefill_tokens_cut": 1 - new["padded_prefill_tokens"] / max(base["padded_prefill_tokens"], 1),
               "padded_decode_rows_cut": 1 - new["padded_decode_rows"] / max(base["padded_decode_rows"], 1),
               "step_time_ratio": new["total_step_s"] / base["total_step_s"]}
    print_table(rows, list(rows[0]))
    print(summary)
    print(f"wrote {write_results('buckets', {'env': environment(), 'rows': rows, 'summary': summary, 'ladders': {'default': default, 'guided': guided}, 'args': vars(args)})}")  # noqa: E501


if __name__ == "__main__":
    main()
