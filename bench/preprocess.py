"""Request preprocessing on the replica's side: inline against the pool (CPU; no GPU needed).

``deploy.preprocess_pool.Preprocessor`` prepares a body up to ``serve.preprocess_inline_bytes``
on the caller's event loop and a larger one in a pool worker. This times, side by side in one
process, with the pool (``inline_bytes=0``, the default) and inline (``--inline-bytes``, 8192):

- ``one``: one body at a time (a lightly loaded server: each request's own preprocessing time),
  median and p99 of ``--requests``;
- ``burst``: ``--burst`` bodies sent at once (rate inf), the median over ``--bursts`` bursts of
  the mean time a body waits for its answer, and of the burst's total.

Bodies: a completion of 512 token ids, and one of about 2 KiB of text (tokenized).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, print_table, write_results  # noqa: E402


def _bodies(vocab: int) -> dict[str, bytes]:
    ids = [(7 * i) % (vocab - 10) + 5 for i in range(512)]
    text = " ".join(f"word{i % 97} of the request" for i in range(110))
    return {"512 ids": json.dumps({"model": "m", "prompt": ids, "max_tokens": 16}).encode(),
            "2 KiB text": json.dumps({"model": "m", "prompt": text, "max_tokens": 16}).encode()}


async def _one(pre, body: bytes, limits, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await pre.prepare("completions", body, limits)
        times.append(time.perf_counter() - start)
    return times


async def _burst(pre, body: bytes, limits, size: int) -> tuple[float, float]:
    start = time.perf_counter()
    done: list[float] = []

    async def one() -> None:
        await pre.prepare("completions", body, limits)
        done.append(time.perf_counter() - start)

    await asyncio.gather(*(one() for _ in range(size)))
    return statistics.mean(done), max(done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-llama", help="checkpoint preset whose tokenizer prepares the bodies")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--inline-bytes", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=10)
    args = ap.parse_args()

    from deploy.preprocess_pool import Preprocessor
    from worker.admission import PromptLimits
    from worker.checkpoint.writer import write_checkpoint
    from worker.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(args.preset, Path(tmp) / args.preset)
        tokenizer = load_tokenizer(path)
        limits = PromptLimits(tokenizer.vocab_size, 4096)
        bodies = _bodies(tokenizer.vocab_size)
        rows = []
        for mode, inline in (("pool", 0), ("inline", args.inline_bytes)):
            pre = Preprocessor(str(path), args.workers, inline, tokenizer)
            try:
                for name, body in bodies.items():
                    one = asyncio.run(_one(pre, body, limits, args.requests))
                    bursts = [asyncio.run(_burst(pre, body, limits, args.burst)) for _ in range(args.bursts)]
                    rows.append({"mode": mode, "body": name, "bytes": len(body),
                                 "one_p50_ms": 1e3 * statistics.median(one),
                                 "one_p99_ms": 1e3 * sorted(one)[int(0.99 * (len(one) - 1))],
                                 "burst_mean_wait_ms": 1e3 * statistics.median(m for m, _ in bursts),
                                 "burst_total_ms": 1e3 * statistics.median(t for _, t in bursts)})
            finally:
                pre.shutdown()
    print(f"{args.burst} bodies a burst, {args.workers} pool workers, inline up to {args.inline_bytes} bytes")
    print_table(rows, ["mode", "body", "bytes", "one_p50_ms", "one_p99_ms", "burst_mean_wait_ms", "burst_total_ms"])
    print(f"wrote {write_results('preprocess', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
