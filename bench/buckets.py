"""Profile-guided ladders against the default ladders at equal graph memory (GPU).

1. Replay the skewed synthetic trace (``worker.traces.skewed_trace``, fixed seed) through an
   engine with the default ladders; record its batch-shape profile.
2. Start a second engine with ``graphs.profile`` set and no explicit budget: the planner
   reshapes both ladders within the memory the default ladders take.
3. Replay the same trace through both; report padded tokens (prefill) and padded rows (decode)
   under each ladder from the recorded histograms, graph memory, and the total step time
   measured in the same run (sum of engine step durations).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from deploy.config import load_config  # noqa: E402
from graphs.planner import expected_padded_rows, expected_padded_tokens  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.traces import run_trace, skewed_trace  # noqa: E402


def run(cfg, trace, seed: int) -> tuple[Engine, float]:
    engine = Engine(cfg)
    run_trace(engine, trace[: len(trace) // 10], seed=seed + 1)  # warm-up (flashinfer JIT, allocator)
    engine.step_stats.clear()
    run_trace(engine, trace, seed=seed)
    return engine, sum(s.duration_s for s in engine.step_stats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    args = ap.parse_args()
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    overrides = [f"model.path={path}", "model.dtype=bfloat16", "scheduler.max_running_requests=128",
                 "graphs.decode.max_batch_size=128", "scheduler.chunked_prefill_size=2048",
                 "graphs.prefill.max_tokens=2048", "cache.num_pages=20000"]
    trace = skewed_trace(args.requests, seed=args.seed)
    default_engine, default_time = run(load_config(None, overrides), trace, args.seed)
    profile = default_engine.worker.profile()
    w = default_engine.worker
    default = {"decode": list(w.runner.decode_graphs.ladder), "prefill": list(w.runner.prefill_graphs.ladder),
               "bytes": w.runner.decode_graphs.backend.resident_bytes + w.runner.prefill_graphs.backend.resident_bytes,
               "slots": w.runner.prefill_graphs.slots, "ratio": w.runner.prefill_graphs.max_padding_ratio}
    default_engine.shutdown()
    del default_engine, w
    torch.cuda.empty_cache()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        profile.save(f.name)
        guided_engine, guided_time = run(load_config(None, [*overrides, f"graphs.profile={f.name}"]), trace, args.seed)
    g = guided_engine.worker
    guided = {"decode": list(g.runner.decode_graphs.ladder), "prefill": list(g.runner.prefill_graphs.ladder),
              "bytes": g.runner.decode_graphs.backend.resident_bytes + g.runner.prefill_graphs.backend.resident_bytes}
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
