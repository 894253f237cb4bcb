"""Fault soak: a fixed-rate load on the Serve app while ranks die, and what survives it.

The load (streamed and non-streamed greedy completions, ``--bad-fraction`` bad inputs, and
``--disconnect-fraction`` clients that hang up mid-stream) runs against a disaggregated fleet
(one prefill and one decode group) while a schedule of faults hits its ranks: SIGKILL of a
decode rank and of a prefill rank, SIGSTOP of a rank for longer than ``cluster.step_timeout_s``,
and a rank killed while its group is starting and while it is capturing (after a kill, the
restarting group's next generation is watched for until it is in that phase). Afterwards the
soak checks what the issue asks of it: no request hung past its deadline; every greedy request
either returned its answer or ended with a clear error after ``cluster.max_attempts``; every bad
input got a 4xx naming the problem; every KV page is back; the Serve replica was never
restarted; its RSS grew by a bounded amount. TTFT and TPOT are reported inside and outside the
fault windows.

What "returned its answer" means depends on the arithmetic (``--text-check``). On the CPU
(float32, one kernel per shape) it is ``exact``: the fault-free text, taken from the same
server before the faults, token for token, so a re-prefilled stream is proven to continue where
it stopped. In bf16 on a GPU greedy text is not a function of the prompt alone: a stream
recomputed after a fault (its prompt and generated tokens prefilled again, by prefill kernels)
and a request batched with others (a GEMM's kernel depends on the batch's rows) can take the
other side of a near-tie, which a random-weight checkpoint has often; vLLM's recompute
preemption behaves the same. There the check is ``complete``: 200, no error, finish reason
``length`` and exactly ``max_tokens`` tokens (``ignore_eos``; streams count them from the usage
chunk), and the texts that differ from the reference are counted apart, inside and outside
the fault windows, as ``diverged``.

``tests/test_soak.py`` runs it on the CPU for a few minutes; on a GPU machine
``PYTHONPATH=/tmp/site:. python3 bench/soak.py --duration-s 600`` runs at ``--load`` (0.7) of the
capacity it measures first. Results go to ``bench/results/soak-*.json`` (and ``$OUT``).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The soak's parts, and the names tests/test_soak.py and tests/test_soak_figures.py take from here.
from bench.soak_faults import (  # noqa: E402
    FLEET,
    GROUPS,
    Fault,
    FaultInjector,
    FaultRecord,
    default_faults,
    replica_pid,
    rss_mb,
)
from bench.soak_figures import TEXT_CHECKS, print_summary, summarize, violations  # noqa: E402
from bench.soak_load import LoadSpec, Outcome, make_prompts, measure_capacity, references, run_load, settle  # noqa: E402

__all__ = ["CPU_OVERRIDES", "FLEET", "GROUPS", "TEXT_CHECKS", "Fault", "FaultRecord", "LoadSpec", "Outcome",
           "default_faults", "keep_outcomes", "main", "make_prompts", "print_summary", "soak", "summarize",
           "violations"]

#: The CPU soak's config: the tiny checkpoint, a small cache, a step timeout a SIGSTOP can pass, and a
#: prefill backend whose capture takes seconds on the CPU (torch.compile of the pieces), so that
#: "killed while capturing" is a window a watcher can hit.
CPU_OVERRIDES = [
    "model.device=cpu", "cache.num_pages=256", "scheduler.max_running_requests=16",
    "scheduler.chunked_prefill_size=512", "graphs.prefill.max_tokens=512", "graphs.prefill.backend=tc_piecewise",
    "graphs.decode.max_batch_size=16", "cluster.mode=disaggregated", "cluster.step_timeout_s=5",
    "cluster.start_timeout_s=180", "cluster.lost_after_s=300", "cluster.max_attempts=3",
    "serve.stream_batching_interval_ms=0",
]


def soak(base: str, spec: LoadSpec, faults: list[Fault], stop_s: float, text_check: str = "exact") -> dict:
    """Run the load with the faults against the app at ``base`` (already healthy); the figures.

    ``text_check``: how a greedy answer is judged, ``exact`` or ``complete`` (module docstring)."""
    refs = asyncio.run(references(base, spec))
    pid = replica_pid()
    rss_start = rss_mb(pid)
    t0 = time.monotonic()
    injector = FaultInjector(base, faults, t0, stop_s)
    injector.start()
    outcomes = asyncio.run(run_load(base, spec))
    injector.join(timeout=injector.wait_s * 2)
    keep_outcomes(outcomes, injector.records)
    usage = asyncio.run(settle(base))
    try:
        pid_after = replica_pid()
    except RuntimeError:
        pid_after = None
    extra = {
        "duration_s": round(time.monotonic() - t0, 1), "rate": spec.rate,
        "pages_leaked": {g: u for g, u in usage.items() if u} or (0 if usage else "no kv_cache_usage_ratio"),
        "replica_restarts": 0 if pid_after == pid else f"replica pid {pid} -> {pid_after}",
        "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_mb(pid), 1) if pid_after == pid else None,
    }
    extra["rss_growth_mb"] = (extra["rss_end_mb"] or rss_start) - rss_start
    return summarize(outcomes, refs, injector.records, extra, spec.max_tokens, text_check)


def keep_outcomes(outcomes: list[Outcome], faults: list[FaultRecord]) -> Path | None:
    """Write every outcome and fault record to ``$OUT`` (gzip, one JSON object a line) before the figures.

    A GPU soak runs ten minutes on borrowed time; whatever happens after the load, its raw record
    comes back and the figures can be computed again here."""
    out = os.environ.get("OUT")
    if not out:
        return None
    path = Path(out, f"soak-outcomes-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.jsonl.gz")
    with gzip.open(path, "wt") as f:
        for record in faults:
            f.write(json.dumps({"fault": asdict(record)}) + "\n")
        for o in outcomes:
            f.write(json.dumps(asdict(o)) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    from bench.common import environment, write_results
    from bench.engine import ensure_checkpoint
    from bench.serve_start import start_app, wait_healthy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity to send")
    ap.add_argument("--rate", type=float, help="requests per second (default: --load x measured capacity)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--step-timeout-s", type=float, default=5.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--cpu", action="store_true", help="the CPU soak config (tests/test_soak.py's)")
    ap.add_argument("--text-check", choices=TEXT_CHECKS,
                    help="how a greedy answer is judged (default: exact on the CPU, complete on a GPU)")
    args = ap.parse_args(argv)

    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    path = ensure_checkpoint("tiny-llama" if cpu else args.preset, Path(args.checkpoints))
    overrides = (CPU_OVERRIDES if cpu else
                 ["cluster.mode=disaggregated", "cluster.gpus_per_rank=0.5", "cache.gpu_memory_fraction=0.4",
                  "cluster.kv_transport=cuda_ipc", "cluster.lost_after_s=300", "cluster.start_timeout_s=600",
                  "serve.stream_batching_interval_ms=0"])
    overrides = [*overrides, f"cluster.step_timeout_s={args.step_timeout_s}", "serve.request_timeout_s=120",
                 *args.set]
    base = start_app(path, overrides, "soak", fleet_name=FLEET)
    wait_healthy(base, 900)
    spec = LoadSpec("soak", make_prompts(16), args.max_tokens, 1.0, args.duration_s, 120.0)
    capacity = measure_capacity(base, spec)
    rate = args.rate or args.load * capacity
    spec = LoadSpec("soak", spec.prompts, args.max_tokens, rate, args.duration_s, 120.0)
    text_check = args.text_check or ("exact" if cpu else "complete")
    figures = soak(base, spec, default_faults(args.duration_s), args.step_timeout_s + 3, text_check)
    figures["capacity_rps"] = capacity
    print_summary(figures)
    found = violations(figures, rss_growth_limit_mb=1024)
    print("violations:", found or "none")
    write_results("soak", {"environment": environment(), "config": overrides, "figures": figures,
                           "violations": found})
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
