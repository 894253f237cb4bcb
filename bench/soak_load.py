"""The fault soak's load: greedy, bad and disconnecting requests at a fixed rate, and what each saw.

Used by :mod:`bench.soak` (the module docstring there says what the soak checks).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

#: Seconds between the soak's progress lines.
PROGRESS_EVERY_S = 30.0

#: Words the prompts are made of (the checkpoint's tokenizer turns them into a few hundred tokens at most).
_WORDS = ("the fleet of graphs sails at dawn and every rank keeps its pages while the decode group "
          "streams tokens back to the client who asked for them").split()


@dataclass
class Outcome:
    """One request as the client saw it (``time.monotonic`` seconds)."""

    kind: str  # greedy | bad | disconnect
    stream: bool
    prompt: int  # index into the prompt set (-1 for bad inputs)
    sent: float
    ended: float = 0.0
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    token_times: list[float] = field(default_factory=list)
    hung: bool = False
    tokens: int | None = None  # completion tokens, from the usage the server reported


# ----- HTTP -----

async def get_health(session, base: str) -> dict:
    async with session.get(f"{base}/health") as r:
        return await r.json()


def group_phase(health: dict, group_id: str) -> str | None:
    """A group's lifecycle phase (starting, capturing, ready, dead, ...) as ``/health`` reports it."""
    phases = health.get("phases") or {}
    return phases.get(group_id) or (health.get("groups") or {}).get(group_id)


async def kv_usage(session, base: str) -> dict[str, float]:
    """``kv_cache_usage_ratio`` of every group from ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    usage = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kv_cache_usage_ratio":
                usage[s.labels.get("group", "?")] = s.value
    return usage


# ----- the load -----

@dataclass(frozen=True)
class LoadSpec:
    model: str
    prompts: list[str]
    max_tokens: int
    rate: float  # requests per second
    duration_s: float
    deadline_s: float  # the server's request deadline (serve.request_timeout_s)
    bad_fraction: float = 0.1
    disconnect_fraction: float = 0.1
    stream_fraction: float = 0.5
    seed: int = 0


#: Bad inputs, each answered with a 4xx naming the problem (name, body or raw bytes).
BAD_INPUTS = (
    ("empty prompt", {"prompt": ""}),
    ("token outside vocabulary", {"prompt": [10**9]}),
    ("negative max_tokens", {"max_tokens": -1}),
    ("unknown model", {"model": "no-such-model"}),
    ("temperature of the wrong type", {"temperature": "hot"}),
    ("malformed JSON", b'{"prompt": "unterminated'),
    ("too many choices", {"n": 1000}),
)


def _body(spec: LoadSpec, prompt: str, stream: bool) -> dict:
    body = {"model": spec.model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _greedy(session, base: str, spec: LoadSpec, out: Outcome) -> None:
    body = _body(spec, spec.prompts[out.prompt], out.stream)
    async with session.post(f"{base}/v1/completions", json=body) as r:
        out.status = r.status
        if not out.stream or r.status != 200:
            data = await r.json(content_type=None)
            if r.status == 200:
                out.text, out.finish_reason = data["choices"][0]["text"], data["choices"][0]["finish_reason"]
                out.tokens = data["usage"]["completion_tokens"]
            else:
                out.error = (data.get("error") or {}).get("message", str(data))
            return
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out.error = data["error"].get("message", str(data))
                continue
            if data.get("usage"):
                out.tokens = data["usage"]["completion_tokens"]
            if not data.get("choices"):
                continue  # the usage chunk
            choice = data["choices"][0]
            if choice.get("text"):
                out.token_times.append(time.monotonic())
                out.text += choice["text"]
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]


async def _bad(session, base: str, spec: LoadSpec, out: Outcome, rng: random.Random) -> None:
    name, change = BAD_INPUTS[rng.randrange(len(BAD_INPUTS))]
    kwargs = {"data": change, "headers": {"Content-Type": "application/json"}} if isinstance(change, bytes) \
        else {"json": {**_body(spec, spec.prompts[0], False), **change}}
    async with session.post(f"{base}/v1/completions", **kwargs) as r:
        out.status = r.status
        data = await r.json(content_type=None)
        out.error = f"{name}: {(data.get('error') or {}).get('message') if isinstance(data, dict) else data}"


async def _disconnect(session, base: str, spec: LoadSpec, out: Outcome, rng: random.Random) -> None:
    """A stream whose client hangs up after a few chunks (or at once, before any)."""
    after = rng.randrange(0, 3)
    async with session.post(f"{base}/v1/completions", json=_body(spec, spec.prompts[out.prompt], True)) as r:
        out.status = r.status
        seen = 0
        async for line in r.content:
            if line.startswith(b"data: "):
                seen += 1
            if seen >= after:
                break
        r.close()  # drop the connection with the stream unfinished


async def run_load(base: str, spec: LoadSpec) -> list[Outcome]:
    """Send ``spec.rate`` requests a second for ``spec.duration_s``; wait for all to end or time out."""
    import aiohttp

    rng = random.Random(spec.seed)
    outcomes: list[Outcome] = []
    tasks = []
    limit = spec.deadline_s + 30  # a request still open past its deadline plus this is hung
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def one(out: Outcome) -> None:
            try:
                if out.kind == "greedy":
                    coro = _greedy(session, base, spec, out)
                elif out.kind == "bad":
                    coro = _bad(session, base, spec, out, random.Random(rng.random()))
                else:
                    coro = _disconnect(session, base, spec, out, random.Random(rng.random()))
                await asyncio.wait_for(coro, limit)
            except asyncio.TimeoutError:
                out.hung = True
            except (aiohttp.ClientError, ValueError) as e:
                out.error = f"client: {type(e).__name__}: {e}"
            out.ended = time.monotonic()

        start = time.monotonic()
        progress = asyncio.create_task(_report_progress(session, base, outcomes, start))
        n = int(spec.duration_s * spec.rate)
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / spec.rate - time.monotonic()))
            u = rng.random()
            kind = "bad" if u < spec.bad_fraction else \
                "disconnect" if u < spec.bad_fraction + spec.disconnect_fraction else "greedy"
            out = Outcome(kind, kind != "bad" and (kind == "disconnect" or rng.random() < spec.stream_fraction),
                          -1 if kind == "bad" else rng.randrange(len(spec.prompts)), time.monotonic())
            outcomes.append(out)
            tasks.append(asyncio.create_task(one(out)))
        await asyncio.gather(*tasks)
        progress.cancel()
    return outcomes


async def _report_progress(session, base: str, outcomes: list[Outcome], start: float,
                           every_s: float = PROGRESS_EVERY_S) -> None:
    """Print a line every ``every_s``: requests sent, ended (by status), still open, and the groups' health,
    so a soak cut short (a device session's end) still says how far it got and what it saw."""
    while True:
        await asyncio.sleep(every_s)
        ended = [o for o in outcomes if o.ended]
        statuses: dict[str, int] = {}
        for o in ended:
            key = "hung" if o.hung else str(o.status or "client error")
            statuses[key] = statuses.get(key, 0) + 1
        try:
            groups = (await asyncio.wait_for(get_health(session, base), 10.0)).get("groups")
        except Exception as e:  # noqa: BLE001 - a progress line, not a check
            groups = f"no answer ({type(e).__name__})"
        print(f"[soak {time.monotonic() - start:6.0f}s] sent {len(outcomes)}, ended {len(ended)} {statuses}, "
              f"open {len(outcomes) - len(ended)}; groups {groups}", flush=True)


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randrange(8, 120))) for _ in range(n)]


async def references(base: str, spec: LoadSpec) -> list[str]:
    """Each prompt's greedy text from the same server before any fault."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        texts = []
        for prompt in spec.prompts:
            async with session.post(f"{base}/v1/completions", json=_body(spec, prompt, False)) as r:
                data = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"reference request failed: {r.status} {data}")
                texts.append(data["choices"][0]["text"])
        return texts


async def settle(base: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Wait until every group is ready and holds no KV page (or time runs out); the last usage seen."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        end, usage = time.monotonic() + timeout_s, {}
        while time.monotonic() < end:
            health = await get_health(session, base)
            usage = await kv_usage(session, base)
            if set((health.get("groups") or {}).values()) == {"ready"} and usage and not any(usage.values()):
                break
            await asyncio.sleep(0.5)
        return usage


def measure_capacity(base: str, spec: LoadSpec, num: int = 64) -> float:
    """Requests per second the app completes with ``num`` greedy requests sent at once."""
    import aiohttp

    async def go() -> float:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(i: int) -> None:
                async with session.post(f"{base}/v1/completions",
                                        json=_body(spec, spec.prompts[i % len(spec.prompts)], False)) as r:
                    await r.read()
            start = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(num)))
            return num / (time.monotonic() - start)

    return asyncio.run(go())
