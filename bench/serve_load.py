"""The load side of ``bench/serve.py``: streamed completions sent with Poisson arrivals, timed per chunk.

Each request is ``POST /v1/completions`` with ``stream: true`` and ``stream_options.include_usage``
over aiohttp (present wherever Ray Serve is). A request's token times are the arrival times of
its SSE chunks that carry text (as in ``vllm bench serve``); its output length is the usage the
server reports. TTFT = first token - send; TPOT = (e2e - TTFT) / (output tokens - 1); ITL = the
gaps between token chunks; e2e = last byte - send.
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


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (ids below 10 left out: specials in small vocabularies)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(n)]


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
                   headers: dict | None = None, timeout_s: float = 3600.0) -> tuple[list[RequestRecord], float]:
    """Send every prompt (Poisson arrivals at ``rate`` per second; ``inf``: all at once) and wait for all.

    Returns the records, in send order, and the wall time from the first send to the last answer.
    """
    rng = random.Random(seed)
    url = f"{base}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrent streams
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        start = time.perf_counter()
        for ids in prompts:
            body = {"model": model, "prompt": ids, "max_tokens": output_len, "stream": True, "temperature": 0,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            tasks.append(asyncio.create_task(_one(session, url, body, headers or {})))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


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


def steady_decode_rate(records: list[RequestRecord]) -> float | None:
    """Decode tokens/s of requests sent together, while every one of them is decoding: the tokens
    received from the last first token to the first last token, over that window's length (the
    whole span of each request's tokens if that window is empty). Counting tokens over a window,
    not gaps between them, stays right when the server sends several tokens in one write or
    (stream batching) in one chunk: a chunk counts the tokens its running usage says it carries."""
    ok = [r for r in records if r.ok and len(r.token_times) > 1]
    if not ok:
        return None
    lo, hi = max(r.token_times[0] for r in ok), min(r.token_times[-1] for r in ok)
    if hi <= lo:
        lo, hi = min(r.token_times[0] for r in ok), max(r.token_times[-1] for r in ok)
        if hi <= lo:
            return None
    tokens = sum(n for r in ok for t, n in zip(r.token_times, r.chunk_tokens()) if lo < t <= hi)
    return tokens / (hi - lo)
