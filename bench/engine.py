"""Eager decode step time of the engine (graphs off) against the HBM floor: the baseline.

For each preset and attention backend: B requests of ``--context`` prompt tokens are prefilled,
then full engine decode steps (schedule + plan + forward + sample + read tokens) are timed.
The HBM floor is (weight bytes + KV bytes read) / device-to-device copy bandwidth measured in
the same run. Usage (GPU machine): ``python bench/engine.py [--presets ...] [--batches ...]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, environment, print_table, wall_times, write_results  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker.checkpoint import write_checkpoint  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402


def ensure_checkpoint(preset: str, root: Path) -> Path:
    path = root / preset
    if not (path / "config.json").is_file():
        write_checkpoint(preset, path, seed=0, dtype="bfloat16",
                         device="cuda" if torch.cuda.is_available() else "cpu")
    return path


def decode_floor_bytes(engine: Engine, batch: int, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for p in engine.worker.model.parameters())
    emb = engine.worker.model.embed_tokens.weight
    if not engine.arch.tie_word_embeddings:
        weights -= emb.numel() * emb.element_size()  # only B rows of the input embedding are read
        weights += batch * emb.shape[1] * emb.element_size()
    cache = engine.worker.kv_cache
    kv_per_token = cache.shape.bytes_per_page(cache.dtype) // cache.page_size
    return weights + batch * (context + 1) * kv_per_token


def decode_step_times(engine: Engine, batch: int, context: int, repeats: int, g: torch.Generator,
                      inspect=None, **sampling) -> list[float]:
    """Wall seconds of ``repeats`` whole engine decode steps of ``batch`` greedy requests of ``context``
    random prompt tokens (``sampling``: more SamplingParams fields); ``inspect(request)`` sees the
    first request before they are all aborted."""
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True, **sampling)
    ids = [engine.add_request(torch.randint(10, engine.arch.vocab_size, (context,), generator=g).tolist(), params)
           for _ in range(batch)]
    while any(engine.requests[i].prefilling for i in ids):
        engine.step()
    times = wall_times(engine.step, repeats=repeats, warmup=3)
    assert all(s.phase == "decode" and s.batch_size == batch for s in list(engine.step_stats)[-repeats:]), \
        "a step that was not the batch's decode"
    if inspect is not None:
        inspect(engine.requests[ids[0]])
    for i in ids:
        engine.abort(i)
        engine.release(i)
    return times


def bench_one(path: Path, backend: str, batches: list[int], context: int, repeats: int, bw: float) -> list[dict]:
    max_b = max(batches)
    pages = max_b * (-(-(context + repeats + 16) // 16)) + 64
    cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", f"attention.backend={backend}",
                             "graphs.enabled=false",
                             f"cache.num_pages={pages}", f"scheduler.max_running_requests={max_b}"])
    engine = Engine(cfg)
    rows = []
    g = torch.Generator().manual_seed(0)
    for b in batches:
        step = statistics.median(decode_step_times(engine, b, context, repeats, g))
        floor = decode_floor_bytes(engine, b, context) / bw
        rows.append({"preset": path.name, "backend": engine.worker.attention.name, "batch": b, "context": context,
                     "step_ms": step * 1e3, "floor_ms": floor * 1e3, "x_floor": step / floor,
                     "tokens_per_s": b / step})
    del engine
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tinyllama-1.1b,llama-3-8b")
    ap.add_argument("--backends", default="torch,flashinfer")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    rows = []
    for preset in args.presets.split(","):
        path = ensure_checkpoint(preset, Path(args.checkpoints))
        for backend in args.backends.split(","):
            rows += bench_one(path, backend, [int(b) for b in args.batches.split(",")], args.context,
                              args.repeats, bw)
    print_table(rows, ["preset", "backend", "batch", "context", "step_ms", "floor_ms", "x_floor", "tokens_per_s"])
    out = write_results("engine", {"env": environment(), "copy_bandwidth_Bps": bw, "rows": rows,
                                   "args": vars(args)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
