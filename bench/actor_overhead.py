"""Decode step of a fleet group's engine (run beside its leader rank) against the same engine in-process.

Both run the same config (full decode graphs on a GPU) side by side in one run. For each batch
the fleet side is a colocated fleet of one group (TP=1, the default config) with ``batch``
streams decoding: ``leader_step_ms`` is the median engine step on the leader (from its own step
stats: scheduling, the step, sampling read-back and detokenization, as in-process), and
``delivered_step_ms`` is what the fleet's clients see: ``batch`` over the tokens per second that
reach their request handles in a window of steady decoding (the fleet loop, the reports and the
event delivery included). Without a GPU it runs the same comparison on the CPU (graphs off) with
``--preset tiny-llama``. ``leader_interval_ms`` is the window over the leader's steps in it
(a step's own time plus whatever the loop does between steps).
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

from bench.common import decode_step_breakdown, environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from deploy.config import load_config  # noqa: E402
from fleet.fleet import Fleet  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402


def _leader_stats(actor) -> list[tuple[str, int, float]]:
    """(phase, batch size, seconds) of every step the leader's engine has kept."""
    def steps(a):
        return [(s.phase, s.batch_size, s.duration_s) for s in list(a.host.engine.step_stats)]

    return ray.get(actor.__ray_call__.remote(steps), timeout=60)


def fleet_decode(fleet: Fleet, batch: int, context: int, window_s: float, vocab: int) -> dict[str, float]:
    """Steady decode of ``batch`` streams through ``fleet``: the leader's engine step and the
    step that the tokens reaching the clients imply (seconds)."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    [member] = fleet.members
    leader = member.group.rank_actors()[0]
    handles = [fleet.submit(torch.randint(10, vocab, (context,), generator=g).tolist(), params)
               for _ in range(batch)]
    try:
        end = time.monotonic() + 600
        while min(len(h.token_times) for h in handles) < 8:
            if time.monotonic() > end:
                raise RuntimeError("the fleet's streams did not start decoding within 600 s")
            time.sleep(0.05)
        since = len(_leader_stats(leader))
        t0 = time.monotonic()
        time.sleep(window_s)
        t1 = time.monotonic()
        stats = _leader_stats(leader)[since:]
        delivered = sum(sum(1 for t in h.token_times if t0 <= t < t1) for h in handles)
    finally:
        for h in handles:
            h.abort()
    decode = [d for phase, b, d in stats if phase == "decode" and b == batch]
    return {"leader_step_s": statistics.median(decode), "delivered_step_s": batch * (t1 - t0) / delivered,
            "leader_interval_s": (t1 - t0) / len(stats), "leader_steps": len(stats),
            "other_steps": len(stats) - len(decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--window-s", type=float, default=3.0, help="steady-decoding window of the fleet side")
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
    vocab = local.arch.vocab_size
    local_times = {b: decode_step_breakdown(local, b, args.context, args.repeats) for b in batches}
    local.shutdown()
    del local
    if cuda:
        torch.cuda.empty_cache()
    ray.init(_node_ip_address="127.0.0.1", num_gpus=torch.cuda.device_count(), include_dashboard=False)
    with Fleet.start(cfg, name="overhead", max_waiting_requests=max(batches) * 2) as fleet:
        fleet_times = {b: fleet_decode(fleet, b, args.context, args.window_s, vocab) for b in batches}
    ray.shutdown()
    rows = []
    for b in batches:
        loc, fl = local_times[b], fleet_times[b]
        rows.append({
            "preset": args.preset, "batch": b, "in_process_ms": loc["step_s"] * 1e3,
            "leader_step_ms": fl["leader_step_s"] * 1e3, "leader_interval_ms": fl["leader_interval_s"] * 1e3,
            "delivered_step_ms": fl["delivered_step_s"] * 1e3,
            "leader_over_in_process": fl["leader_step_s"] / loc["step_s"],
            "delivered_over_in_process": fl["delivered_step_s"] / loc["step_s"],
            "leader_steps": fl["leader_steps"], "other_steps": fl["other_steps"]})
    print_table(rows, list(rows[0]))
    print(f"wrote {write_results('actor_overhead', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
