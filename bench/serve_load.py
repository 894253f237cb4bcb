"""The load side of ``bench/serve.py``: streamed completions sent with Poisson arrivals, timed per chunk.

Each request is ``POST /v1/completions`` with ``stream: true`` and ``stream_options.include_usage``
over aiohttp (present wherever Ray Serve is). A request's token times are the arrival times of
its SSE chunks that carry text (as in ``vllm bench serve``); its output length is the usage the
server reports. TTFT = first token - send; TPOT = (e2e - TTFT) / (output tokens - 1); ITL = the
gaps between token chunks; e2e = last byte - send. :func:`steady_decode_rate` is the decode rate of
requests sent together and :func:`window_diagnostics` says what its window looked like (why a run was
slow); :class:`ClientCpu` samples this process's CPU clocks while :func:`run_load` runs, for it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np


@dataclass
class RequestRecord:
    """One request as the client saw it (``time.perf_counter`` seconds)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)  # completion tokens so far at each token chunk
    done: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    def chunk_tokens(self) -> list[int]:
        """Tokens each token chunk carried (1 each where the server sent no running usage)."""
        if len(self.token_counts) != len(self.token_times):
            return [1] * len(self.token_times)
        return [b - a for a, b in zip([0, *self.token_counts], self.token_counts)]

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class ClientCpu:
    """The load client's CPU clocks, sampled by a task of :func:`run_load`'s event loop every
    ``interval_s`` (and once at its start and end): (``time.perf_counter``, ``time.process_time``
    of this whole process, ``time.thread_time`` of the thread running the event loop). A sampler,
    not a sample per chunk: reading the two CPU clocks costs about a microsecond, which at every
    chunk of 64 streams would itself be a load on the client it measures."""

    interval_s: float = 0.005
    samples: list[tuple[float, float, float]] = field(default_factory=list)

    def sample(self) -> None:
        self.samples.append((time.perf_counter(), time.process_time(), time.thread_time()))

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def seconds(self, lo: float, hi: float) -> tuple[float, float] | None:
        """(process, event-loop thread) CPU seconds between ``perf_counter`` times ``lo`` and ``hi``,
        interpolated linearly between samples; None if the samples do not cover ``[lo, hi]``."""
        if len(self.samples) < 2 or self.samples[0][0] > lo or self.samples[-1][0] < hi:
            return None
        t, proc, thread = (np.array(c) for c in zip(*self.samples))
        return (float(np.interp(hi, t, proc) - np.interp(lo, t, proc)),
                float(np.interp(hi, t, thread) - np.interp(lo, t, thread)))


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (ids below 10 left out: specials in small vocabularies)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(n: int, prefix_len: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` prompts of one common ``prefix_len``-token system prompt followed by ``length`` distinct
    random tokens each (issue 20's shared-prefix load: 1,024 common + 64 distinct)."""
    common = random_prompts(1, prefix_len, vocab_size, seed)[0]
    return [common + tail for tail in random_prompts(n, length, vocab_size, seed + 1)]


async def _one(session: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> RequestRecord:
    rec = RequestRecord(sent=time.perf_counter())
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "error event")
                    continue
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    rec.token_times.append(now)
                    if chunk.get("usage"):  # continuous usage: how many tokens this chunk completes
                        rec.token_counts.append(chunk["usage"]["completion_tokens"])
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.done = time.perf_counter()
    if rec.error is None and not rec.token_times:
        rec.error = "no token in the stream"
    return rec


async def run_load(base: str, model: str, prompts: list[list[int]], output_len: int, rate: float, seed: int,
                   headers: dict | None = None, timeout_s: float = 3600.0,
                   cpu: ClientCpu | None = None) -> tuple[list[RequestRecord], float]:
    """Send every prompt (Poisson arrivals at ``rate`` per second; ``inf``: all at once) and wait for all.

    Returns the records, in send order, and the wall time from the first send to the last answer.
    With ``cpu``, its sampler runs alongside from before the first send to after the last answer.
    """
    rng = random.Random(seed)
    url = f"{base}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrent streams
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        sampler = None
        if cpu is not None:
            cpu.sample()
            sampler = asyncio.create_task(cpu.run())
        start = time.perf_counter()
        for ids in prompts:
            body = {"model": model, "prompt": ids, "max_tokens": output_len, "stream": True, "temperature": 0,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            tasks.append(asyncio.create_task(_one(session, url, body, headers or {})))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if sampler is not None:
            sampler.cancel()
            cpu.sample()
    return list(records), duration


def _ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q) * 1e3) if values else None


def summarize(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict:
    """Throughputs, goodput and p50/p99 of TTFT, TPOT, ITL and e2e (milliseconds)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [g for r in ok for g in r.itls]
    e2e = [r.e2e for r in ok]

    def good(r: RequestRecord) -> bool:
        if slo_ttft_ms is not None and r.ttft * 1e3 > slo_ttft_ms:
            return False
        return slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms

    out = {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration, "output_throughput": sum(r.output_tokens for r in ok) / duration,
           "goodput": sum(good(r) for r in ok) / duration}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = _ms(values, 50), _ms(values, 99)
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def _window(records: list[RequestRecord]) -> tuple[list[RequestRecord], float, float, bool] | None:
    """(the requests counted, lo, hi, fallback) of :func:`steady_decode_rate`'s window."""
    ok = [r for r in records if r.ok and len(r.token_times) > 1]
    if not ok:
        return None
    lo, hi = max(r.token_times[0] for r in ok), min(r.token_times[-1] for r in ok)
    if hi > lo:
        return ok, lo, hi, False
    lo, hi = min(r.token_times[0] for r in ok), max(r.token_times[-1] for r in ok)
    return (ok, lo, hi, True) if hi > lo else None


def _window_tokens(r: RequestRecord, lo: float, hi: float) -> int:
    return sum(n for t, n in zip(r.token_times, r.chunk_tokens()) if lo < t <= hi)


def steady_decode_rate(records: list[RequestRecord]) -> float | None:
    """Decode tokens/s of requests sent together, while every one of them is decoding: the tokens
    received from the last first token to the first last token, over that window's length (the
    whole span of each request's tokens if that window is empty). Counting tokens over a window,
    not gaps between them, stays right when the server sends several tokens in one write or
    (stream batching) in one chunk: a chunk counts the tokens its running usage says it carries."""
    window = _window(records)
    if window is None:
        return None
    ok, lo, hi, _ = window
    return sum(_window_tokens(r, lo, hi) for r in ok) / (hi - lo)


def window_diagnostics(records: list[RequestRecord], cpu: ClientCpu | None = None) -> dict | None:
    """What :func:`steady_decode_rate`'s window looked like, to tell why a run was slow (None where
    it has no window). Keys:

    - ``window_s``: the window's length (last first token to first last token); ``fallback``: True
      where that was empty and the whole span of every request's tokens was used instead.
    - ``first_token_spread_ms``: the last first token minus the first first token. A wide spread
      (prefill of the batch staggered) shortens the window for the same tokens per request.
    - ``requests``: requests counted (answered, two token chunks or more); ``requests_in_window``:
      those with a chunk counted inside the window; ``tokens_in_window``: the tokens counted.
    - ``max_chunk_gap_ms``: the longest stretch inside the window in which no token chunk of any
      stream arrived (the window's ends are chunk arrivals): a stall of the whole pipeline.
    - ``client_cpu_share`` / ``client_loop_cpu_share``: CPU seconds of this process (which runs the
      load client) / of the thread running its event loop over the window, over the window's
      length (None without ``cpu``, or if its samples do not cover the window). The loop's share
      near 1.0 means the client saturates a core and the rate is the client's, not the server's.
    """
    window = _window(records)
    if window is None:
        return None
    ok, lo, hi, fallback = window
    span = hi - lo
    firsts = [r.token_times[0] for r in ok]
    counted = [_window_tokens(r, lo, hi) for r in ok]
    arrivals = sorted(t for r in ok for t in r.token_times if lo <= t <= hi)
    used = cpu.seconds(lo, hi) if cpu is not None else None
    return {"window_s": span, "fallback": fallback, "first_token_spread_ms": (max(firsts) - min(firsts)) * 1e3,
            "requests": len(ok), "requests_in_window": sum(n > 0 for n in counted),
            "tokens_in_window": sum(counted),
            "max_chunk_gap_ms": max(b - a for a, b in zip(arrivals, arrivals[1:])) * 1e3,
            "client_cpu_share": used[0] / span if used else None,
            "client_loop_cpu_share": used[1] / span if used else None}
