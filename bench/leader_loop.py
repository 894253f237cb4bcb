"""What a group's engine loop and its report link add to the engine's own host work, on any machine.

Serve delivers less than the in-process engine at batch 64 on the H200 (``serve.py --compare``),
and the group's leader is host-bound there. Part of its host work is the engine's (scheduling, the
step message, reading tokens back, detokenizing, stop decisions: ``host_step.py``); the rest is the
group's: the loop of :class:`cluster.engine_host.EngineHost` (commands between steps, publishing a
step's events, the load the router weighs) and the report link's thread, which takes each report,
pickles it and sends it under the same GIL (:mod:`cluster.report_link`). This bench times both
with no device and no model: the engine runs over :class:`bench.host_step.HostOnlyExecutor`, which
answers every step at once, so a step is host work only.

A step can also wait for a stand-in device (``--device-ms``: each step that long, one after another,
read back by sleeping, so the loop lets go of the GIL as it does on a GPU); without one the loop
never waits, and the report link's thread gets the GIL only when the interpreter takes it from the
loop (every 5 ms), so its reports come several steps at a time.

- ``engine``: ``engine.step()`` in a loop until ``--batch`` greedy requests have made
  ``--tokens`` tokens each (what ``serve.py --compare`` times in-process, minus the device);
- ``group``: the same requests admitted to an ``EngineHost`` whose loop runs on its own thread,
  its reports sent by a real ``ReportServer`` to a ``ReportReader`` in another process (the fleet's
  end), which unpickles them and counts tokens; timed from the first token event to the last.

``--switch-interval-ms`` (default Python's 5) runs the group at each of several
``sys.setswitchinterval`` values, interleaved in one run: how long the loop may wait for the GIL
while the report link's thread pickles (the engine alone has one thread and is unaffected).

Per decode step in microseconds, and their ratio. The model is loaded on the CPU for its geometry
only, so any machine runs it the same way: ``python bench/leader_loop.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from bench.host_step import HostOnlyExecutor  # noqa: E402
from cluster.engine_host import EngineHost  # noqa: E402
from cluster.group_messages import Admit  # noqa: E402
from cluster.report_link import LinkAddress, ReportReader, ReportServer  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402
from worker.worker import Worker  # noqa: E402


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(batch)]


def time_engine(cfg, worker: Worker, prompts: list[list[int]], tokens: int, device_s: float) -> tuple[float, int]:
    """(seconds from the first decode step to the last, decode steps) of ``engine.step()`` in a loop."""
    engine = Engine(cfg, executor=HostOnlyExecutor(worker, device_s=device_s))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for ids in prompts:
        engine.add_request(ids, params)
    while engine.scheduler.waiting or any(r.prefilling for r in engine.scheduler.running):
        engine.step()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


def _read_reports(address: LinkAddress, want_tokens: int, out) -> None:
    """The fleet's end, in its own process: read reports until ``want_tokens`` tokens came; send
    (first token event's time, last's, tokens, reports) back through ``out``."""
    reader = ReportReader(address)
    out.send("connected")
    first = last = None
    tokens = reports = 0
    while tokens < want_tokens:
        report = reader.read(60.0)
        reports += 1
        n = sum(len(ev.token_ids) for ev in report.events)
        if n:
            now = time.perf_counter()
            first = now if first is None else first
            last, tokens = now, tokens + n
    reader.close()
    out.send((first, last, tokens, reports))


def time_group(cfg, worker: Worker, prompts: list[list[int]], tokens: int,
               device_s: float) -> tuple[float, int, int]:
    """(seconds from the first token event the reader got to the last, decode steps, reports) of an
    ``EngineHost`` serving the same requests through its report link."""
    executor = HostOnlyExecutor(worker, device_s=device_s)

    def no_kv(*_args):
        raise RuntimeError("no hand-offs in this bench")

    host = EngineHost(cfg, executor, "colocated", executor.max_len, no_kv, no_kv, no_kv)
    server = ReportServer("127.0.0.1", host.take_report, lambda: host.stopping)
    server.start()
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    reader = ctx.Process(target=_read_reports, args=(server.address, len(prompts) * tokens, theirs), daemon=True)
    reader.start()
    # Admit only once the reader is connected and the server has accepted it: reports taken before
    # would pile up into one (a whole run's worth, on a fast host).
    if not mine.poll(120) or mine.recv() != "connected":
        raise SystemExit("the report reader did not connect within 120 s")
    end = time.monotonic() + 10
    while server._conn is None and time.monotonic() < end:
        time.sleep(0.01)
    loop = threading.Thread(target=host.run, name="engine-loop", daemon=True)
    loop.start()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    host.put(1, [Admit(f"r{i}", ids, params, i, [], [], False) for i, ids in enumerate(prompts)])
    if not mine.poll(600):
        raise SystemExit("the reader got no answer within 600 s")
    first, last, got, reports = mine.recv()
    reader.join(10)
    host.stop()
    loop.join(10)
    server.close()
    # Every request's first token comes from its prefill step; the decode steps make the rest.
    return last - first, tokens - 1, reports


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=600, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode (the median is reported)")
    ap.add_argument("--device-ms", default="0,1.0",
                    help="comma-separated stand-in device step times (0: none; see HostOnlyExecutor)")
    ap.add_argument("--switch-interval-ms", default="5",
                    help="comma-separated sys.setswitchinterval values for the group runs (ms)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = ap.parse_args(argv)

    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    B = args.batch
    pages = B * (-(-(args.prompt_len + args.tokens + 16) // 16)) + 64
    overrides = [f"model.path={path}", f"cache.num_pages={pages}", f"scheduler.max_running_requests={B}",
                 "model.device=cpu", "attention.backend=torch", "graphs.enabled=false"]
    cfg = load_config(None, overrides + args.set)
    worker = Worker.local(cfg)  # its geometry only: the executor answers without it
    prompts = _prompts(B, args.prompt_len, worker.arch.vocab_size)

    intervals = [float(x) for x in args.switch_interval_ms.split(",")]
    default_interval = sys.getswitchinterval()
    rows = []
    for device_ms in [float(x) for x in args.device_ms.split(",")]:
        engine_us: list[float] = []
        group_us: dict[float, list[float]] = {i: [] for i in intervals}
        reports: dict[float, list[int]] = {i: [] for i in intervals}
        for _ in range(args.repeats):  # interleaved, so drift on a busy host hits every mode alike
            seconds, steps = time_engine(cfg, worker, prompts, args.tokens, device_ms / 1e3)
            engine_us.append(seconds / steps * 1e6)
            for interval in intervals:
                sys.setswitchinterval(interval / 1e3)
                try:
                    seconds, steps, n = time_group(cfg, worker, prompts, args.tokens, device_ms / 1e3)
                finally:
                    sys.setswitchinterval(default_interval)
                group_us[interval].append(seconds / steps * 1e6)
                reports[interval].append(n)
        engine = sorted(engine_us)[len(engine_us) // 2]
        for interval in intervals:
            group = sorted(group_us[interval])[len(group_us[interval]) // 2]
            rows.append({"device_ms": device_ms, "switch_interval_ms": interval, "engine_us": engine,
                         "group_us": group, "group_over_engine": group / engine,
                         "engine_runs_us": [round(x) for x in engine_us],
                         "group_runs_us": [round(x) for x in group_us[interval]], "reports": reports[interval]})
    print(f"{args.preset}, batch {B}, prompt {args.prompt_len}, {args.tokens} tokens each, host-only executor")
    print_table(rows, ["device_ms", "switch_interval_ms", "engine_us", "group_us", "group_over_engine",
                       "engine_runs_us", "group_runs_us",
                       "reports"])
    out = write_results("leader_loop", {"env": environment(), "args": vars(args), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
