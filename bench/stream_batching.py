"""Decode tokens/s through Serve against the in-process engine, per stream batching interval.

One run: the in-process engine's decode step at ``--batch`` requests, then for each interval of
``--intervals`` (``serve.stream_batching_interval_ms``) an app on one local Ray Serve, ``--batch``
streamed completions sent at once, and from /proc the CPU seconds per output token, while they
ran, of the Serve replica's HTTP side (every thread but the fleet's: the API, streaming, Serve's
request handling), of its fleet threads (the fleet loop: routing and delivering events; each
group's report receiver and rank watcher), of the group's engine loop thread on its leader rank (scheduling, the
step's launch, waiting on it, detokenizing) and of the rest of that rank process, and of
Serve's HTTP proxy; and, from ``/metrics``, the share of a core the engine loop burns while it
waits on a step (``engine_wait_core_share``: the read-back's CPU seconds over its wait seconds,
``graphfleet_step_wait_*_seconds_total``; 0 on CPU, where a step has run when it returns). The apps run one
after the other (each is deleted before the next starts), so they never share the device.

GPU machine: ``PYTHONPATH=/tmp/site:. python3 bench/stream_batching.py``. Here, on CPU:
``python bench/stream_batching.py --preset tiny-llama --batch 32 --input-len 64 --output-len 128``
(the rank's CPU forward then sets the pace: the replica's CPU per token is the number to read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from bench.serve import CPU_OVERRIDES, in_process_decode, step_wait_totals  # noqa: E402
from bench.serve_load import random_prompts, run_load, steady_decode_rate, summarize  # noqa: E402
from bench.serve_start import _get, start_serve, wait_healthy  # noqa: E402


def threads_cpu_s(title: str) -> dict[str, float]:
    """User + system CPU seconds so far of every thread (by OS name) of the processes whose
    command line contains ``title``."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for line in subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines():
        pid, _, cmd = line.strip().partition(" ")
        if title not in cmd:
            continue
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def cpu_split(before: dict[str, float], after: dict[str, float], *prefixes: str) -> tuple[float, float]:
    """(CPU seconds of the threads whose names start with one of ``prefixes``, of every other
    thread) between two :func:`threads_cpu_s`."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    mine = sum(v for k, v in delta.items() if prefixes and k.startswith(prefixes))
    return mine, sum(delta.values()) - mine


def measure(base: str, app: str, args: argparse.Namespace, vocab: int, in_process_tps: float) -> dict:
    model = json.loads(_get(f"{base}/v1/models")[1])["data"][0]["id"]
    for ids in random_prompts(2, args.input_len, vocab, args.seed + 1):  # first kernels and shapes
        asyncio.run(run_load(base, model, [ids], 16, float("inf"), args.seed))
    prompts = random_prompts(args.batch, args.input_len, vocab, args.seed + 7)
    titles = {"replica": f"ServeReplica:{app}:", "proxy": "ProxyActor", "rank": "FleetRankActor"}
    before = {k: threads_cpu_s(t) for k, t in titles.items()}
    waits_before = step_wait_totals(_get(f"{base}/metrics")[1])
    records, duration = asyncio.run(run_load(base, model, prompts, args.output_len, float("inf"), args.seed))
    after = {k: threads_cpu_s(t) for k, t in titles.items()}
    waits = {k: v - waits_before[k] for k, v in step_wait_totals(_get(f"{base}/metrics")[1]).items()}
    loop_s, serving_s = cpu_split(before["replica"], after["replica"], "graphfleet-loop", "reports-", "loops-")
    proxy_s = sum(cpu_split(before["proxy"], after["proxy"]))
    engine_s, rank_rest_s = cpu_split(before["rank"], after["rank"], "engine-loop")
    stats = summarize(records, duration, None, None)
    tokens = sum(r.output_tokens for r in records if r.ok)
    chunks = sum(len(r.token_times) for r in records if r.ok)
    served = steady_decode_rate(records)
    return {"completed": stats["completed"], "serve_tokens_per_s": served,
            "serve_over_in_process": served / in_process_tps if served else None,
            "tokens_per_chunk": tokens / chunks if chunks else None,
            "replica_http_cpu_us_per_token": serving_s / tokens * 1e6 if tokens else None,
            "fleet_loop_cpu_us_per_token": loop_s / tokens * 1e6 if tokens else None,
            "engine_loop_cpu_us_per_token": engine_s / tokens * 1e6 if tokens else None,
            "engine_loop_core_share": engine_s / duration if duration else None,
            # While it waits on a step: the share of a core the waiting thread (the engine loop) burns.
            "engine_wait_s": waits["wait_s"],
            "engine_wait_core_share": waits["cpu_s"] / waits["wait_s"] if waits["wait_s"] > 0 else None,
            "rank_other_cpu_us_per_token": rank_rest_s / tokens * 1e6 if tokens else None,
            "proxy_cpu_us_per_token": proxy_s / tokens * 1e6 if tokens else None,
            **{k: stats[k] for k in ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--intervals", default="0,50", help="serve.stream_batching_interval_ms values, comma separated")
    ap.add_argument("--batch", type=int, default=64, help="streams sent at once (and the in-process batch)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--direct-ingress", action="store_true",
                    help="clients talk to the ingress replica's own HTTP server, not through Serve's proxy")
    args = ap.parse_args()

    import ray
    from ray import serve

    from deploy.serve_app import app_builder

    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    overrides = ([] if torch.cuda.is_available() else list(CPU_OVERRIDES)) + [
        f"scheduler.max_running_requests={max(args.batch, 8)}", *args.set]
    in_process = in_process_decode(path, overrides, args.batch, args.input_len, repeats=20)
    port = start_serve(args.direct_ingress)
    rows = []
    try:
        for i, ms in enumerate(float(v) for v in args.intervals.split(",")):
            app = f"sb{i}"
            built = app_builder({"model": str(path), "model_name": args.preset, "fleet": {"name": app},
                                 "overrides": [*overrides, f"serve.stream_batching_interval_ms={ms:g}"]})
            # A direct-ingress replica serves its app at its own root (one app at a time here).
            prefix = "/" if args.direct_ingress else f"/{app}"
            serve.run(built, name=app, route_prefix=prefix, blocking=False)
            base = f"http://127.0.0.1:{port}{prefix.rstrip('/')}"
            wait_healthy(base, 1800)
            rows.append({"interval_ms": ms, **measure(base, app, args, vocab, in_process["tokens_per_s"])})
            serve.delete(app)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"in-process: {in_process['tokens_per_s']:.0f} tokens/s at batch {args.batch} "
          f"({in_process['step_ms']:.2f} ms per step)")
    print_table(rows, ["interval_ms", "serve_tokens_per_s", "serve_over_in_process", "tokens_per_chunk",
                       "replica_http_cpu_us_per_token", "fleet_loop_cpu_us_per_token", "proxy_cpu_us_per_token",
                       "engine_loop_cpu_us_per_token", "engine_loop_core_share", "engine_wait_core_share",
                       "ttft_p50_ms", "tpot_p50_ms",
                       "itl_p50_ms", "itl_p99_ms"])
    out = write_results("stream_batching", {"env": environment(), "args": vars(args), "overrides": overrides,
                                            "in_process": in_process, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
