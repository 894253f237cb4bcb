"""Decode step of a fleet group's engine (run beside its leader rank) against the same engine in-process.

Both run the same config (full decode graphs on a GPU) side by side in one run. For each batch
the fleet side is a colocated fleet of one group (TP=1, the default config) with ``batch``
streams decoding: ``leader_step_ms`` is the median engine step on the leader (from its own step
stats: scheduling, the step, sampling read-back and detokenization, as in-process), and
``delivered_step_ms`` is what the fleet's clients see: ``batch`` over the tokens per second that
reach their request handles in a window of steady decoding (the fleet loop, the reports and the
event delivery included). Without a GPU it runs the same comparison on the CPU (graphs off) with
``--preset tiny-llama``. ``leader_interval_ms`` is the window over the leader's steps in it
(a step's own time plus whatever the loop does between steps); ``wait_core_share`` is the CPU the
engine loop's thread spends while it waits for a step's tokens over that wait (GPU only), and
``wait_ms_per_step`` / ``wait_cpu_ms_per_step`` are that wait and its CPU per decode step: a
share near 1 over a wait of a few microseconds is a loop that never waits (the host is the bound),
not a spinning one.

Every row is measured with synchronous and with async scheduling (``--scheduling``), in-process
and fleet alike, so the default can follow the faster. ``--profile-s N`` samples the leader's
process with py-spy (when it is installed) for N seconds at the largest batch of each mode and
prints where the engine loop's thread is when it is not inside a step, and which threads of the
process burn CPU beside it (the raw samples go beside the JSON).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from bench.common import RESULTS, decode_step_breakdown, environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from deploy.config import load_config  # noqa: E402
from fleet.fleet import Fleet  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402


def _leader_stats(actor) -> list[tuple[str, int, float, float, float]]:
    """(phase, batch size, seconds, waited seconds, CPU seconds while waiting) of every step the
    leader's engine has kept."""
    def steps(a):
        return [(s.phase, s.batch_size, s.duration_s, s.wait_s, s.wait_cpu_s) for s in list(a.host.engine.step_stats)]

    return ray.get(actor.__ray_call__.remote(steps), timeout=60)


def _py_spy(pid: int, seconds: float, idle: bool, out: Path) -> list[tuple[list[str], int]]:
    """Stacks (outermost first) and sample counts of process ``pid`` over ``seconds``; with ``idle``
    threads that wait (sleep, GIL, locks) are sampled too."""
    cmd = [_py_spy_path() or "py-spy", "record", "-p", str(pid), "-d", str(max(1, round(seconds))),
           "-r", "250", "--nonblocking", "-f", "raw", "-o", str(out)] + (["--idle"] if idle else [])
    subprocess.run(cmd, check=True, capture_output=True, timeout=seconds + 60)
    stacks = []
    for line in out.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        stacks.append((stack.split(";"), int(n)))
    return stacks


def _py_spy_path() -> str | None:
    """py-spy on PATH, beside this Python, or where the GPU machine's wheels install (/tmp/site/bin)."""
    for candidate in (shutil.which("py-spy"), Path(sys.executable).parent / "py-spy", Path("/tmp/site/bin/py-spy")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def _frame(f: str) -> str:
    name, _, where = f.partition(" (")
    return f"{name}:{where.rsplit(':', 1)[-1].rstrip(')')}"


def leader_profile(pid: int, seconds: float, tag: str) -> dict:
    """Where the engine loop's thread is outside a step (all samples, waits included), and the
    CPU-burning samples of every thread of the leader's process, by thread and by top frames."""
    out_dir = Path(os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    for idle in (True, False):
        stacks = _py_spy(pid, seconds, idle, out_dir / f"actor_overhead-pyspy-{tag}-{'all' if idle else 'cpu'}.txt")
        loop_total, where, threads = 0, collections.Counter(), collections.Counter()
        for frames, n in stacks:
            run = next((i for i, f in enumerate(frames) if f.startswith("EngineHost.run ")), None)
            if run is None:
                threads[frames[0] if idle else " > ".join(_frame(f) for f in frames[1:4])] += n
                continue
            loop_total += n
            threads["engine loop"] += n
            inner = frames[run + 1:]
            if inner and inner[0].startswith("Engine.step "):
                ours = [f for f in inner if any(f"({pkg}/" in f for pkg in ("worker", "graphs", "cluster"))]
                where["step: " + " < ".join(_frame(f) for f in reversed(ours[-2:]))] += n
            else:
                where[" > ".join(_frame(f) for f in inner[:3]) or "EngineHost.run"] += n
        key = "engine_loop_all_samples" if idle else "cpu_samples"
        result[key] = {"engine_loop_total": loop_total, "engine_loop_where": dict(where.most_common(12)),
                       "threads": dict(threads.most_common(12))}
    return result


def _decoding(fleet: Fleet, batch: int, context: int, vocab: int, seed: int) -> list:
    """``batch`` fresh greedy streams of ``context`` random prompt tokens, each past its 8th token."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    handles = [fleet.submit(torch.randint(10, vocab, (context,), generator=g).tolist(), params)
               for _ in range(batch)]
    end = time.monotonic() + 600
    while min(len(h.token_times) for h in handles) < 8:
        if time.monotonic() > end:
            for h in handles:
                h.abort()
            raise RuntimeError("the fleet's streams did not start decoding within 600 s")
        time.sleep(0.05)
    return handles


def fleet_decode(fleet: Fleet, batch: int, context: int, window_s: float, vocab: int,
                 profile_s: float = 0.0, tag: str = "") -> dict[str, float]:
    """Steady decode of ``batch`` streams through ``fleet``: the leader's engine step and the
    step that the tokens reaching the clients imply (seconds); with ``profile_s``, py-spy's view
    of the leader over fresh streams afterwards."""
    [member] = fleet.members
    leader = member.group.rank_actors()[0]
    handles = _decoding(fleet, batch, context, vocab, batch)
    try:
        since = len(_leader_stats(leader))
        t0 = time.monotonic()
        time.sleep(window_s)
        t1 = time.monotonic()
        stats = _leader_stats(leader)[since:]
        delivered = sum(sum(1 for t in h.token_times if t0 <= t < t1) for h in handles)
    finally:
        for h in handles:
            h.abort()
    profile = None
    if profile_s > 0:
        handles = _decoding(fleet, batch, context, vocab, batch + 1)
        try:
            pid = ray.get(leader.__ray_call__.remote(lambda a: os.getpid()), timeout=60)
            profile = leader_profile(pid, profile_s, tag)
        finally:
            for h in handles:
                h.abort()
    decode = [s for s in stats if s[0] == "decode" and s[1] == batch]
    waited = sum(s[3] for s in decode)
    return {"leader_step_s": statistics.median(s[2] for s in decode),
            "delivered_step_s": batch * (t1 - t0) / delivered,
            "leader_interval_s": (t1 - t0) / len(stats), "leader_steps": len(stats),
            "other_steps": len(stats) - len(decode),
            "wait_core_share": sum(s[4] for s in decode) / waited if waited > 0 else None,
            "wait_ms_per_step": 1e3 * waited / len(decode) if decode else None,
            "wait_cpu_ms_per_step": 1e3 * sum(s[4] for s in decode) / len(decode) if decode else None,
            "profile": profile}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--window-s", type=float, default=2.0,
                    help="steady-decoding window of the fleet side (the streams must not reach max_model_len in it)")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--scheduling", default="sync,async", help="scheduler modes to measure (sync, async)")
    ap.add_argument("--profile-s", type=float, default=0.0,
                    help="py-spy the leader for this many seconds at the largest batch of each mode (0: no)")
    args = ap.parse_args()
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    batches = [int(b) for b in args.batches.split(",")]
    cuda = torch.cuda.is_available()
    overrides = [f"model.path={path}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
                 f"model.device={'cuda' if cuda else 'cpu'}", f"scheduler.max_running_requests={max(batches)}",
                 f"graphs.decode.max_batch_size={max(batches)}", "graphs.capture=decode",
                 # room for every stream's whole window (a preempted stream would make other steps)
                 f"cache.num_pages={max(batches) * ((args.context + 2600) // 16 + 1) + 64}"]
    default_async = load_config(None, []).scheduler.async_scheduling
    profile_s = args.profile_s if args.profile_s > 0 and _py_spy_path() else 0.0
    if args.profile_s > 0 and not profile_s:
        print("py-spy is not installed: no profile")
    ray.init(_node_ip_address="127.0.0.1", num_gpus=torch.cuda.device_count(), include_dashboard=False)
    rows, profiles = [], {}
    for mode in args.scheduling.split(","):
        if mode not in ("sync", "async"):
            raise SystemExit(f"--scheduling: unknown mode {mode!r} (sync, async)")
        cfg = load_config(None, overrides + [f"scheduler.async_scheduling={str(mode == 'async').lower()}"])
        local = Engine(cfg)
        vocab = local.arch.vocab_size
        local_times = {b: decode_step_breakdown(local, b, args.context, args.repeats) for b in batches}
        local.shutdown()
        del local
        if cuda:
            torch.cuda.empty_cache()
        with Fleet.start(cfg, name=f"overhead-{mode}", max_waiting_requests=max(batches) * 2) as fleet:
            fleet_times = {b: fleet_decode(fleet, b, args.context, args.window_s, vocab,
                                           profile_s if b == max(batches) else 0.0, f"{mode}-{b}") for b in batches}
        for b in batches:
            loc, fl = local_times[b], fleet_times[b]
            if fl["profile"] is not None:
                profiles[f"{mode}-{b}"] = fl["profile"]
            rows.append({
                "preset": args.preset,
                "scheduling": mode + (" (default)" if (mode == "async") == default_async else ""),
                "batch": b, "in_process_ms": loc["step_s"] * 1e3,
                "leader_step_ms": fl["leader_step_s"] * 1e3, "leader_interval_ms": fl["leader_interval_s"] * 1e3,
                "delivered_step_ms": fl["delivered_step_s"] * 1e3,
                "leader_over_in_process": fl["leader_step_s"] / loc["step_s"],
                "interval_over_in_process": fl["leader_interval_s"] / loc["step_s"],
                "delivered_over_in_process": fl["delivered_step_s"] / loc["step_s"],
                "wait_core_share": fl["wait_core_share"], "wait_ms_per_step": fl["wait_ms_per_step"],
                "wait_cpu_ms_per_step": fl["wait_cpu_ms_per_step"],
                "leader_steps": fl["leader_steps"], "other_steps": fl["other_steps"]})
    ray.shutdown()
    for tag, prof in profiles.items():
        print(f"\nleader profile {tag}: the engine loop's samples (waits included), by where it is")
        p = prof["engine_loop_all_samples"]
        for where, n in p["engine_loop_where"].items():
            print(f"  {n / max(1, p['engine_loop_total']):6.1%}  {where}")
        c = prof["cpu_samples"]
        print(f"leader profile {tag}: on-CPU samples by thread (engine loop on CPU in "
              f"{c['engine_loop_total']} of {p['engine_loop_total']} of its samples)")
        for thread, n in c["threads"].items():
            print(f"  {n:6d}  {thread}")
    print()
    print_table(rows, list(rows[0]))
    payload = {"env": environment(), "rows": rows, "profiles": profiles, "args": vars(args)}
    print(f"wrote {write_results('actor_overhead', payload)}")


if __name__ == "__main__":
    main()
