"""Shared benchmark plumbing: environment record, bandwidth probe, timing, results."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def commit() -> str:
    """The commit being measured: $GRAPHFLEET_COMMIT, git, or ``.graphfleet-commit`` at the repo root
    (the GPU machine's copy has no .git: write that file with ``make stamp`` and carry it)."""
    if os.environ.get("GRAPHFLEET_COMMIT"):
        return os.environ["GRAPHFLEET_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    stamp = root / ".graphfleet-commit"
    if stamp.is_file() and not (root / ".git").is_dir():
        return stamp.read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=root).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        stamp = root / ".graphfleet-commit"
        return stamp.read_text().strip() if stamp.is_file() else "unknown"


def environment() -> dict:
    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):  # the allocator's settings change every memory number
        env["alloc_conf"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except Exception:  # noqa: BLE001
        pass
    return env


def copy_bandwidth(nbytes: int = 2 * 2**30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of repeats."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = cuda_times(lambda: dst.copy_(src), repeats=repeats, warmup=3)
    return 2 * nbytes / statistics.median(times)


def cuda_times(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    """Seconds per call of ``fn``, timed with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def wall_times(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    """Seconds per call of a ``fn`` that synchronises itself (e.g. an engine step)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def interleaved_wall_times(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None],
                           warmup: int = 3, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Wall seconds per call of each of ``fns``, timed in rounds: each round calls every function once,
    ``sync`` after each call, starting one function later than the round before. Drift over the run
    (clocks, heat, the host's other work) then falls on every function alike, so their ratios are
    fair where one-after-the-other timing is not. ``warmup`` untimed rounds come first; ``clock``
    reads seconds."""
    names = list(fns)
    if not names:
        return {}
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            t = clock()
            fns[name]()
            sync()
            if r >= warmup:
                out[name].append(clock() - t)
    return out


def decode_step_breakdown(engine, batch: int, context: int, repeats: int) -> dict[str, float]:
    """Median seconds of an engine step decoding ``batch`` requests of ``context`` random prompt
    tokens (after their prefill), and of its parts from the engine's step stats: ``execute_s`` (the
    executor call) and ``rank_s`` (the rank's own Worker.execute; ``execute_s - rank_s`` is the hop
    to the rank). The requests are aborted and released afterwards."""
    from worker.sampling.params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(10, engine.arch.vocab_size, (context,), generator=g).tolist(), params)
           for _ in range(batch)]
    while any(engine.requests[i].prefilling for i in ids):
        engine.step()
    step = statistics.median(wall_times(engine.step, repeats=repeats, warmup=5))
    timed = list(engine.step_stats)[-repeats:]
    for i in ids:
        engine.abort(i)
        engine.release(i)
    return {"step_s": step, "execute_s": statistics.median(s.execute_s for s in timed),
            "rank_s": statistics.median(s.rank_s for s in timed)}


def decode_step_seconds(engine, batch: int, context: int, repeats: int) -> float:
    """Median seconds of an engine step decoding ``batch`` requests (see :func:`decode_step_breakdown`)."""
    return decode_step_breakdown(engine, batch, context, repeats)["step_s"]


def add_preset_arguments(ap, presets: str, batches: str, context: int = 512) -> None:
    """The arguments most benches share: ``--presets`` and ``--batches`` (comma-separated),
    ``--context`` (prompt tokens) and ``--checkpoints`` (where generated checkpoints are kept)."""
    ap.add_argument("--presets", default=presets)
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--context", type=int, default=context)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = RESULTS / f"{name}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, path.name).write_text(json.dumps(payload, indent=2))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)
