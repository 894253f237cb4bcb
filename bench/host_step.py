"""Host time per decode step of the engine's pieces at one batch, on any machine.

The engine loop of a group's leader is host-bound once its device work is short (on the H200,
tinyllama-1.1b at batch 64: 2.4 ms of host work a step against 1.8 ms of device work). This bench
runs the real engine (CPU: the torch attention backend; GPU: flashinfer, graphs as configured)
with ``--batch`` requests of ``--context`` prompt tokens that have already made ``--warm-tokens``
tokens each (long outputs, as a long generation has), and times each host piece of the step with a
wrapper on it: scheduling, the step message, the step's inputs, attention planning, sampling
parameters, the output processor (appending tokens, detokenizing, stop decisions), and the
device-facing pieces' host time: sampling's launches, graph replays (``cudaGraphLaunch`` returns
once the graph is queued), the read-back's copy and its wait (the step's one sync, so it holds
whatever device time the host did not cover). The rest of the step is the step minus the pieces.
Read the pieces, not the total, on a CPU: there the forward dominates. ``--top-logprobs K``: every
request asks for log-probabilities with K alternatives (issue 19's load).

``--executor host`` runs the engine over :class:`HostOnlyExecutor` instead, which answers each step
at once with random tokens (no model, no device): the step is then only the engine's own host work
(scheduling, the step message, reading tokens back into requests, detokenizing, stop decisions),
the part of a leader's loop that is the same on every machine, timed without a forward between
steps (so with warm caches; on the GPU host the loop never waits for a CPU forward either).

``python bench/host_step.py`` (tiny-llama on a CPU); on the GPU machine ``--preset tinyllama-1.1b``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker import model_runner, step_pipeline  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.gc_heap import freeze_startup_heap  # noqa: E402
from worker.sampling import sampler  # noqa: E402
from worker.sampling.packed_rows import unpack_lists  # noqa: E402
from worker.sampling.params import MAX_TOP_LOGPROBS, SamplingParams  # noqa: E402
from worker.step_message import StepMessage, StepResult  # noqa: E402
from worker.worker import Worker  # noqa: E402


class _Answered:
    def __init__(self, result: StepResult, done_at: float) -> None:
        self._result, self._done_at = result, done_at

    def result(self) -> StepResult:
        wait = self._done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # as a device wait does, this lets other threads have the GIL
        return self._result


class HostOnlyExecutor:
    """An executor with the worker's geometry that answers every step at once: one uniformly random
    token per sampled row (printable ids, so the text grows as a model's would), and when a row asks
    for log-probabilities, random ones (with alternatives) unpacked from packed rows as the worker's
    read-back does.

    ``device_s`` > 0 stands in for a device: steps run one after another, each ``device_s`` long from
    when it was submitted or the one before it ended, and reading a result sleeps until then.
    """

    def __init__(self, worker: Worker, seed: int = 0, device_s: float = 0.0) -> None:
        self.arch, self.num_pages, self.max_len = worker.arch, worker.num_pages, worker.max_len
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(seed)
        self._packed: dict[int, np.ndarray] = {}  # width -> packed rows (packed_rows' layout)
        self._low, self._high = 10, worker.arch.vocab_size - 1
        self.device_s = device_s
        self._device_free_at = 0.0

    def submit(self, msg: StepMessage) -> _Answered:
        randint = self._rng.randint
        done_at = 0.0
        if self.device_s > 0:
            done_at = self._device_free_at = max(time.perf_counter(), self._device_free_at) + self.device_s
        tokens = [randint(self._low, self._high) for _ in msg.logits_rows]
        if not any(p.logprobs for p in msg.params):
            return _Answered(StepResult(token_ids=tokens), done_at)
        # as the worker's read-back of packed rows (readback.sample_lists): the same host work, over
        # rows of random log-probabilities drawn once per width
        width = MAX_TOP_LOGPROBS if any(p.top_logprobs for p in msg.params) else 0
        rows = self._packed.get(width)
        if rows is None or rows.shape[0] < len(tokens):
            rows = self._packed[width] = self._random_rows(max(len(tokens), 256), width)
        packed = rows[:len(tokens)]
        packed[:, 0] = tokens
        tokens, logprobs, tops = unpack_lists(packed)
        return _Answered(StepResult(token_ids=tokens, logprobs=logprobs, top_logprobs=tops), done_at)

    def _random_rows(self, n: int, width: int) -> np.ndarray:
        packed = self._np_rng.integers(self._low, self._high, (n, 2 + 2 * width), dtype=np.int32)
        packed[:, 1:2].view(np.float32)[:] = -self._np_rng.random((n, 1), dtype=np.float32)
        if width:
            packed[:, 2 + width:].view(np.float32)[:] = -np.sort(self._np_rng.random((n, width), dtype=np.float32))
        return packed

    def shutdown(self) -> None:
        pass


class PieceTimer:
    """Accumulated seconds and calls per named piece."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
                self.calls[name] += 1
        return timed


def instrument(engine: Engine, timer: PieceTimer, worker: bool) -> None:
    """Wrap the engine's host pieces (instance attributes and the module functions the pipeline
    calls), and with ``worker`` those of its local worker."""
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.output_processor.append_tokens = timer.wrap("output processor", engine.output_processor.append_tokens)
    step_pipeline.build_step_message = timer.wrap("step message", step_pipeline.build_step_message)
    if worker:
        runner = engine.worker.runner
        runner.prepare = timer.wrap("step inputs", runner.prepare)
        runner.attention.plan = timer.wrap("attention plan", runner.attention.plan)
        build = sampler.SamplingBatch.build
        sampler.SamplingBatch.build = timer.wrap("sampling params", build)
        # the device-facing pieces (their host time: a launch returns once it is queued)
        model_runner.sample = timer.wrap("sample (launches)", model_runner.sample)
        for phase_runner in (runner.decode_runner, runner.prefill_runner):
            backend = getattr(phase_runner, "backend", None)
            if backend is not None and not hasattr(backend.replay, "timed_piece"):
                backend.replay = timer.wrap("graph replay (launch)", backend.replay)
                backend.replay.timed_piece = True
        readback = engine.worker._readback
        readback.copy = timer.wrap("read-back copy", readback.copy)
        readback.wait = timer.wrap("read-back wait", readback.wait)


def prepared(args: argparse.Namespace, cfg, sampling: dict) -> tuple[Engine, PieceTimer]:
    """An engine (over the real worker or the host-only executor) with ``--batch`` requests decoding
    with ``sampling``, past their prefill and ``--warm-tokens`` steps, its pieces instrumented."""
    engine = Engine(cfg, executor=HostOnlyExecutor(Worker.local(cfg))) if args.executor == "host" else Engine(cfg)
    timer = PieceTimer()
    instrument(engine, timer, args.executor == "worker")
    g = torch.Generator().manual_seed(0)
    max_tokens = args.warm_tokens + args.steps * (args.rounds if args.pair else 1) + 16
    for _ in range(args.batch):
        engine.add_request(torch.randint(10, engine.arch.vocab_size - 10, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
    while engine.scheduler.waiting or any(r.prefilling for r in engine.scheduler.running):
        engine.step()
    for _ in range(args.warm_tokens):
        engine.step()
    return engine, timer


def timed_steps(engine: Engine, timer: PieceTimer, steps: int) -> float:
    """Seconds of ``steps`` engine steps, its pieces timed."""
    timer.on = True
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    timer.on = False
    return time.perf_counter() - started


def piece_rows(timer: PieceTimer, steps: int, step_s: float) -> list[dict]:
    rows = [{"piece": name, "us_per_step": timer.seconds[name] / steps * 1e6,
             "calls_per_step": timer.calls[name] / steps}
            for name in sorted(timer.seconds, key=timer.seconds.get, reverse=True)]
    rows.append({"piece": "pieces, summed", "us_per_step": sum(timer.seconds.values()) / steps * 1e6,
                 "calls_per_step": None})
    rows.append({"piece": "whole step", "us_per_step": step_s * 1e6, "calls_per_step": 1.0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--warm-tokens", type=int, default=300, help="tokens each request has made before timing")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--greedy", action="store_true",
                    help="greedy requests (temperature 0, what bench/serve.py sends) instead of top-p sampling")
    ap.add_argument("--top-logprobs", type=int, default=None,
                    help="every request asks for log-probabilities and this many alternatives (0-20)")
    ap.add_argument("--pair", action="store_true",
                    help="with --top-logprobs: also an engine without log-probabilities, the two run in --rounds "
                         "interleaved rounds of --steps steps (median of the rounds, and of their paired ratios)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--executor", choices=("worker", "host"), default="worker",
                    help="worker: the real forward; host: HostOnlyExecutor (the engine's host work alone)")
    args = ap.parse_args()
    if args.pair and args.top_logprobs is None:
        ap.error("--pair compares --top-logprobs K with none: give K")

    cuda = torch.cuda.is_available()
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    B, ctx = args.batch, args.context
    steps_total = args.steps * (args.rounds if args.pair else 1)
    pages = (2 if args.pair else 1) * B * (-(-(ctx + args.warm_tokens + steps_total + 32) // 16)) + 64
    overrides = [f"model.path={path}", f"cache.num_pages={pages}", f"scheduler.max_running_requests={B}"]
    if not cuda:
        overrides += ["model.device=cpu", "attention.backend=torch", "graphs.enabled=false"]
    cfg = load_config(None, overrides + args.set)
    # By default sampled, top-p on (the path a chat request takes); --greedy: the serve benchmarks' path.
    sampling = dict(temperature=0.0) if args.greedy else dict(temperature=0.8, top_p=0.95)
    asked = dict(sampling)
    if args.top_logprobs is not None:  # issue 19's load: log-probabilities with alternatives on every row
        asked.update(logprobs=True, top_logprobs=args.top_logprobs)
    header = (f"{args.preset}, batch {B}, context {ctx} + {args.warm_tokens} made, {'cuda' if cuda else 'cpu'}, "
              f"executor {args.executor}, {'greedy' if args.greedy else 'top-p'}, "
              f"async_scheduling={cfg.scheduler.async_scheduling}")
    if not args.pair:
        engine, timer = prepared(args, cfg, asked)
        step_s = timed_steps(engine, timer, args.steps) / args.steps
        rows = piece_rows(timer, args.steps, step_s)
        print(f"{header}, top_logprobs={args.top_logprobs}")
        print_table(rows, ["piece", "us_per_step", "calls_per_step"])
        write_results("host_step", {"env": environment(), "args": vars(args), "batch": len(engine.scheduler.running),
                                    "rows": rows})
        return
    variants = {"none": prepared(args, cfg, sampling), f"top{args.top_logprobs}": prepared(args, cfg, asked)}
    freeze_startup_heap("host_step")  # as a rank actor, whose engine loop this is
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (engine, timer) in variants.items():
            seconds[name].append(timed_steps(engine, timer, args.steps) / args.steps)
    for name, (engine, _) in variants.items():
        stats = list(engine.step_stats)[-args.steps:]
        assert all(s.phase == "decode" and s.batch_size == B for s in stats), \
            f"{name}: a step was not the batch's decode"
    top = f"top{args.top_logprobs}"
    steps = args.steps * args.rounds
    rows = [{"variant": name, "step_us": statistics.median(s) * 1e6, **{
        f"{r['piece']}_us": r["us_per_step"] for r in piece_rows(variants[name][1], steps, statistics.median(s))
        if r["calls_per_step"]}} for name, s in seconds.items()]
    ratios = [t / n for t, n in zip(seconds[top], seconds["none"])]
    print(f"{header}: none beside top_logprobs={args.top_logprobs}, {args.rounds} interleaved rounds of {args.steps}")
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))
    delta = rows[1]["step_us"] - rows[0]["step_us"]
    print(f"{top} over none: {rows[1]['step_us'] / rows[0]['step_us']:.3f} (medians), "
          f"{statistics.median(ratios):.3f} (median of paired rounds), +{delta:.1f} us")
    write_results("host_step", {"env": environment(), "args": vars(args), "rows": rows, "paired_ratios": ratios,
                                "median_paired_ratio": statistics.median(ratios)})


if __name__ == "__main__":
    main()
