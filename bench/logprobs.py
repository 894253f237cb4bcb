"""What log-probabilities and penalties cost an engine decode step: none, the chosen token's, the
top 20 on every row (issue 19: within 5% of none at batch 64), and presence, frequency and
repetition penalties on every row.

One engine per preset (decode graphs on, the default config otherwise); for each batch, B requests
of ``--context`` prompt tokens are prefilled and whole engine steps (schedule, plan, replay,
sample, read back, detokenize) are timed with the batch's rows asking for nothing, for logprobs,
for logprobs with top_logprobs=20 and for the three penalties, in ``--rounds`` interleaved rounds (the variants see the
same machine state; each round runs them in an order rotated by one from the last, so none always
follows the same one); each variant's step is the median over its rounds, and each ratio over none
is also given as the median of the rounds' own ratios with a bootstrap 95% interval (the host-bound
tinyllama step spreads 10-15% between rounds: its 5% goal is met only where the interval's top is
under 1.05). The engine's startup heap
is frozen for the garbage collector first, as a serving rank actor's is (``--no-freeze-gc``: not).
First, the tail alone:
the fused log-probability kernels against the torch ops they replace, as graph replays at the
preset's vocabulary. Usage (GPU machine):
``python bench/logprobs.py [--presets ...] [--batches ...]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_preset_arguments, environment, print_table, write_results  # noqa: E402
from bench.engine import decode_step_times, ensure_checkpoint  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.gc_heap import freeze_startup_heap  # noqa: E402
from worker.sampling.params import MAX_TOP_LOGPROBS  # noqa: E402

VARIANTS = {"none": {}, "logprobs": {"logprobs": True},
            "top20": {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS},
            "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}}


def step_seconds(engine: Engine, batch: int, context: int, repeats: int, fields: dict, g: torch.Generator) -> float:
    """Median wall seconds of an engine decode step with ``batch`` requests sampling with ``fields``."""
    def came_back(req) -> None:
        want = fields.get("top_logprobs", 0)
        assert req.logprobs and (not want or len(req.logprobs[-1][1]) == 4 * want), "no log-probabilities came back"

    inspect = came_back if fields.get("logprobs") else None
    return statistics.median(decode_step_times(engine, batch, context, repeats, g, inspect, **fields))


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high) of ``values``: the median and its bootstrap 95% percentile interval."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return statistics.median(values), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def rotated(names: list[str], k: int) -> list[str]:
    """``names`` starting at its ``k``-th (mod its length): round k's order."""
    k %= len(names)
    return names[k:] + names[:k]


def tail_microseconds(fn, logits: torch.Tensor, tokens: torch.Tensor, width: int, replays: int = 200) -> float:
    """Median device microseconds of ``fn(logits, tokens, width)`` replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(logits, tokens, width)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(logits, tokens, width)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    graph.reset()
    return statistics.median(times)


def tail_rows(preset: str, vocab: int, batches: list[int]) -> list[dict]:
    """The log-probability tail alone, fused kernels against the torch ops they replace (each with
    its packing), per batch and width, as graph replays over float32 logits."""
    from worker.sampling.fused_logprobs import logprob_tail as fused
    from worker.sampling.logprobs import torch_logprobs_of
    from worker.sampling.packed_rows import pack

    def torch_tail(logits, tokens, width):
        chosen, ids, values = torch_logprobs_of(logits, tokens, width)
        return chosen, ids, values, pack(tokens, chosen, ids, values)

    rows = []
    for b in batches:
        g = torch.Generator(device="cuda").manual_seed(b)
        logits = torch.randn(b, vocab, device="cuda", generator=g) * 4
        tokens = torch.randint(0, vocab, (b,), device="cuda", generator=g)
        for width in (0, MAX_TOP_LOGPROBS):
            t_fused = tail_microseconds(fused, logits, tokens, width)
            t_torch = tail_microseconds(torch_tail, logits, tokens, width)
            rows.append({"preset": preset, "vocab": vocab, "batch": b, "width": width, "fused_us": t_fused,
                         "torch_us": t_torch, "fused_over_torch": t_fused / t_torch})
    return rows


def bench_preset(path: Path, batches: list[int], context: int, repeats: int, rounds: int,
                 freeze_gc: bool = True) -> list[dict]:
    max_b = max(batches)
    pages = max_b * (-(-(context + (rounds * len(VARIANTS) + 1) * (repeats + 8)) // 16)) + 64
    engine = Engine(load_config(None, [f"model.path={path}", "model.dtype=bfloat16", f"cache.num_pages={pages}",
                                       f"scheduler.max_running_requests={max_b}",
                                       f"graphs.decode.max_batch_size={max(256, max_b)}"]))
    if freeze_gc:  # as a rank actor does once it has captured (worker/gc_heap.py)
        freeze_startup_heap("bench engine")
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for k in range(rounds):
            for name in rotated(list(VARIANTS), k):
                seconds[name].append(step_seconds(engine, b, context, repeats, VARIANTS[name], g))
        step = {v: statistics.median(s) for v, s in seconds.items()}
        row = {"preset": path.name, "batch": b, "context": context, **{f"{v}_ms": step[v] * 1e3 for v in VARIANTS}}
        for v in ("logprobs", "top20", "penalties"):
            per_round = [t / n for t, n in zip(seconds[v], seconds["none"], strict=True)]
            mid, low, high = median_interval(per_round)
            row |= {f"{v}_over_none": step[v] / step["none"], f"{v}_over_none_per_round": per_round,
                    f"{v}_over_none_median_of_rounds": mid, f"{v}_over_none_ci95": [low, high]}
        rows.append(row)
    del engine
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_preset_arguments(ap, presets="tinyllama-1.1b,llama-3-8b", batches="1,64,256")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-freeze-gc", action="store_true",
                    help="leave the engine's startup heap to the garbage collector (a serving rank freezes it)")
    args = ap.parse_args()
    rows, tails = [], []
    batches = [int(b) for b in args.batches.split(",")]
    for preset in args.presets.split(","):
        path = ensure_checkpoint(preset, Path(args.checkpoints))
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        tails += tail_rows(preset, vocab, batches)
        rows += bench_preset(path, batches, args.context, args.repeats, args.rounds, not args.no_freeze_gc)
    print("The tail alone (graph replays, device us):")
    print_table(tails, ["preset", "vocab", "batch", "width", "fused_us", "torch_us", "fused_over_torch"])
    print("Engine decode steps:")
    print_table(rows, ["preset", "batch", "context", "none_ms", "logprobs_ms", "top20_ms", "penalties_ms",
                       "logprobs_over_none", "top20_over_none", "penalties_over_none"])
    print("top 20 over none, the median of the rounds' own ratios and its bootstrap 95% interval:")
    print_table([{"preset": r["preset"], "batch": r["batch"], "rounds": len(r["top20_over_none_per_round"]),
                  "median": r["top20_over_none_median_of_rounds"], "low": r["top20_over_none_ci95"][0],
                  "high": r["top20_over_none_ci95"][1]} for r in rows],
                ["preset", "batch", "rounds", "median", "low", "high"])
    out = write_results("logprobs", {"env": environment(), "rows": rows, "tail": tails, "args": vars(args)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
