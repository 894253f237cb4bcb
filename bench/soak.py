"""Fault soak: a fixed-rate load on the Serve app while ranks die, and what survives it.

The load (streamed and non-streamed greedy completions, ``--bad-fraction`` bad inputs, and
``--disconnect-fraction`` clients that hang up mid-stream) runs against a disaggregated fleet
(one prefill and one decode group) while a schedule of faults hits its ranks: SIGKILL of a
decode rank and of a prefill rank, SIGSTOP of a rank for longer than ``cluster.step_timeout_s``,
and a rank killed while its group is starting and while it is capturing (after a kill, the
restarting group's next generation is watched for until it is in that phase). Afterwards the
soak checks what the issue asks of it: no request hung past its deadline; every greedy request
either returned its answer or ended with a clear error after ``cluster.max_attempts``; every bad
input got a 4xx naming the problem; every KV page is back; the Serve replica was never
restarted; its RSS grew by a bounded amount. TTFT and TPOT are reported inside and outside the
fault windows.

What "returned its answer" means depends on the arithmetic (``--text-check``). On the CPU
(float32, one kernel per shape) it is ``exact``: the fault-free text, taken from the same
server before the faults, token for token, so a re-prefilled stream is proven to continue where
it stopped. In bf16 on a GPU greedy text is not a function of the prompt alone: a stream
recomputed after a fault (its prompt and generated tokens prefilled again, by prefill kernels)
and a request batched with others (a GEMM's kernel depends on the batch's rows) can take the
other side of a near-tie, which a random-weight checkpoint has often; vLLM's recompute
preemption behaves the same. There the check is ``complete``: 200, no error, finish reason
``length`` and exactly ``max_tokens`` tokens (``ignore_eos``; streams count them from the usage
chunk), and the texts that differ from the reference are counted apart, inside and outside
the fault windows, as ``diverged``.

``tests/test_soak.py`` runs it on the CPU for a few minutes; on a GPU machine
``PYTHONPATH=/tmp/site:. python3 bench/soak.py --duration-s 600`` runs at ``--load`` (0.7) of the
capacity it measures first. Results go to ``bench/results/soak-*.json`` (and ``$OUT``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The fleet's name in the soak app: its groups are ``soak-p0`` (prefill) and ``soak-d0`` (decode).
FLEET = "soak"
GROUPS = {"prefill": f"{FLEET}-p0", "decode": f"{FLEET}-d0"}

#: The CPU soak's config: the tiny checkpoint, a small cache, a step timeout a SIGSTOP can pass, and a
#: prefill backend whose capture takes seconds on the CPU (torch.compile of the pieces), so that
#: "killed while capturing" is a window a watcher can hit.
CPU_OVERRIDES = [
    "model.device=cpu", "cache.num_pages=256", "scheduler.max_running_requests=16",
    "scheduler.chunked_prefill_size=512", "graphs.prefill.max_tokens=512", "graphs.prefill.backend=tc_piecewise",
    "graphs.decode.max_batch_size=16", "cluster.mode=disaggregated", "cluster.step_timeout_s=5",
    "cluster.start_timeout_s=180", "cluster.lost_after_s=300", "cluster.max_attempts=3",
    "serve.stream_batching_interval_ms=0",
]

#: Words the prompts are made of (the checkpoint's tokenizer turns them into a few hundred tokens at most).
_WORDS = ("the fleet of graphs sails at dawn and every rank keeps its pages while the decode group "
          "streams tokens back to the client who asked for them").split()


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``kind`` on a rank of the ``role`` group, ``at_s`` after the load starts.

    kill: SIGKILL rank 0 of the current generation. stop: SIGSTOP it for ``stop_s`` (longer than
    the step timeout), then SIGCONT. kill_starting / kill_capturing: SIGKILL rank 0, then SIGKILL
    rank 0 of the restarting group's next generation as soon as it exists (starting) or once the
    group reports the capturing phase.
    """

    at_s: float
    kind: str
    role: str


def default_faults(duration_s: float) -> list[Fault]:
    """Every fault kind once, spread over the first 85% of ``duration_s``."""
    kinds = [("kill", "decode"), ("kill", "prefill"), ("stop", "decode"), ("kill_starting", "prefill"),
             ("kill_capturing", "prefill")]
    step = duration_s * 0.85 / (len(kinds) + 1)
    return [Fault(round(step * (i + 1), 1), kind, role) for i, (kind, role) in enumerate(kinds)]


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


@dataclass
class FaultRecord:
    """What one fault did: when it hit, which phase the group was in, and when the group was ready again."""

    kind: str
    role: str
    at: float
    hits: list[dict] = field(default_factory=list)  # {"t", "actor", "phase", "signal"}
    ready_again: float | None = None
    error: str | None = None


# ----- the cluster seen from outside: rank actors, their processes, the replica -----

def alive_actors() -> dict[str, int]:
    """Name -> process id of every named actor alive now.

    Read from the GCS actor table (``ray._private.state``): the public state API needs the
    dashboard, and asking an actor for its pid waits behind whatever it is running (a capture).
    """
    from ray._private.state import actors

    return {a["Name"]: a["Pid"] for a in actors().values() if a.get("Name") and a.get("State") == "ALIVE"}


def rank_actors(group_id: str) -> dict[int, tuple[str, int]]:
    """generation -> (name, pid) of rank 0 of each generation of ``group_id`` alive now."""
    prefix = f"graphfleet-{group_id}-"
    found = {}
    for name, pid in alive_actors().items():
        if name.startswith(prefix) and name.endswith("-rank0"):
            found[int(name[len(prefix):].split("-")[0])] = (name, pid)
    return found


def replica_pid(app: str = "graphfleet") -> int:
    """The process of the app's Serve replica (its one ``OpenAIIngress`` replica)."""
    pids = [pid for name, pid in alive_actors().items() if name.startswith(f"SERVE_REPLICA::{app}#OpenAIIngress#")]
    if len(pids) != 1:
        raise RuntimeError(f"expected one replica of app {app!r}, found pids {pids}")
    return pids[0]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ----- HTTP -----

async def _health(session, base: str) -> dict:
    async with session.get(f"{base}/health") as r:
        return await r.json()


def _phase(health: dict, group_id: str) -> str | None:
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
    return outcomes


# ----- the faults -----

class FaultInjector(threading.Thread):
    """Runs the fault schedule against the fleet behind ``base`` (a thread beside the load)."""

    def __init__(self, base: str, faults: list[Fault], t0: float, stop_s: float, wait_s: float = 120.0) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.base, self.faults, self.t0, self.stop_s, self.wait_s = base, faults, t0, stop_s, wait_s
        self.records: list[FaultRecord] = []

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for fault in self.faults:
                await asyncio.sleep(max(0.0, self.t0 + fault.at_s - time.monotonic()))
                record = FaultRecord(fault.kind, fault.role, time.monotonic())
                self.records.append(record)
                try:
                    await self._inject(session, fault, record)
                    record.ready_again = await self._until_ready(session, GROUPS[fault.role])
                except Exception as e:  # noqa: BLE001 - recorded; the checks fail on it
                    record.error = f"{type(e).__name__}: {e}"

    async def _phase(self, session, group_id: str) -> str | None:
        return _phase(await _health(session, self.base), group_id)

    async def _hit(self, session, record: FaultRecord, group_id: str) -> int:
        """SIGKILL rank 0 of the newest generation of ``group_id``; that generation."""
        actors = rank_actors(group_id)
        if not actors:
            raise RuntimeError(f"{group_id} has no live rank 0 to hit")
        gen = max(actors)
        name, pid = actors[gen]
        _signal(record, name, pid, await self._phase(session, group_id), signal.SIGKILL)
        return gen

    async def _hit_next(self, session, record: FaultRecord, group_id: str, after: int, phase: str | None) -> None:
        """SIGKILL rank 0 of the first generation after ``after`` of ``group_id`` as soon as it exists (and the
        group reports ``phase``): the kill follows the sighting with nothing between them, since a capture
        on the GPU lasts seconds."""
        end = time.monotonic() + self.wait_s
        while time.monotonic() < end:
            actors = rank_actors(group_id)
            newer = [g for g in actors if g > after]
            if newer:
                seen = await self._phase(session, group_id)
                if phase is None or seen == phase:
                    name, pid = actors[max(newer)]
                    _signal(record, name, pid, seen, signal.SIGKILL)
                    return
            await asyncio.sleep(0.01)
        raise TimeoutError(f"{group_id}: no generation after {after} in phase {phase} within {self.wait_s}s")

    async def _inject(self, session, fault: Fault, record: FaultRecord) -> None:
        group_id = GROUPS[fault.role]
        if fault.kind == "kill":
            await self._hit(session, record, group_id)
        elif fault.kind == "stop":
            actors = rank_actors(group_id)
            if not actors:
                raise RuntimeError(f"{group_id} has no live rank 0 to stop")
            name, pid = actors[max(actors)]
            phase = await self._phase(session, group_id)
            os.kill(pid, signal.SIGSTOP)
            record.hits.append({"t": time.monotonic(), "actor": name, "phase": phase, "signal": "SIGSTOP"})
            await asyncio.sleep(self.stop_s)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # the group killed it on the step timeout, as it should
        elif fault.kind in ("kill_starting", "kill_capturing"):
            gen = await self._hit(session, record, group_id)
            phase = "capturing" if fault.kind == "kill_capturing" else None
            await self._hit_next(session, record, group_id, gen, phase)
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")

    async def _until_ready(self, session, group_id: str) -> float:
        end = time.monotonic() + self.wait_s
        await asyncio.sleep(0.5)  # let the fleet notice the fault first
        while time.monotonic() < end:
            health = await _health(session, self.base)
            if (health.get("groups") or {}).get(group_id) == "ready":
                return time.monotonic()
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{group_id} not ready again within {self.wait_s}s")


def _signal(record: FaultRecord, actor: str, pid: int, phase: str | None, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise RuntimeError(f"{actor} (pid {pid}) was gone before {signal.Signals(sig).name}") from None
    record.hits.append({"t": time.monotonic(), "actor": actor, "phase": phase, "signal": signal.Signals(sig).name})


# ----- what it shows -----

def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _in_windows(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


#: How a greedy answer is judged (see the module docstring).
TEXT_CHECKS = ("exact", "complete")


def summarize(outcomes: list[Outcome], references: list[str], faults: list[FaultRecord], extra: dict,
              max_tokens: int, text_check: str = "exact") -> dict:
    """The soak's figures (counts, latencies inside and outside fault windows) and its violations."""
    if text_check not in TEXT_CHECKS:
        raise ValueError(f"text_check must be one of {TEXT_CHECKS}, not {text_check!r}")
    windows = [(f.at, (f.ready_again or f.at) + 5.0) for f in faults]

    def inside(o: Outcome) -> bool:
        return _in_windows(o.sent, windows) or _in_windows(o.ended, windows)

    greedy = [o for o in outcomes if o.kind == "greedy"]
    complete = [o for o in greedy if o.status == 200 and o.error is None and o.finish_reason == "length"
                and o.tokens == max_tokens]
    equal = [o for o in complete if o.text == references[o.prompt]]
    gave_up = [o for o in greedy if o.error and "given up" in o.error]
    answered = equal if text_check == "exact" else complete
    lost = [o for o in greedy if o not in answered and o not in gave_up and not o.hung]
    diverged = [o for o in complete if o not in equal]
    bad = [o for o in outcomes if o.kind == "bad"]
    bad_wrong = [o for o in bad if not (400 <= o.status < 500 and o.error and ": " in o.error) or o.hung]
    ttft_in, ttft_out, tpot_in, tpot_out = [], [], [], []
    for o in answered:
        if not o.stream or not o.token_times:
            continue
        (ttft_in if inside(o) else ttft_out).append(o.token_times[0] - o.sent)
        if len(o.token_times) > 1:
            tpot = (o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1)
            (tpot_in if inside(o) else tpot_out).append(tpot)
    figures = {
        "text_check": text_check,
        "requests": len(outcomes), "greedy": len(greedy), "greedy_complete": len(complete),
        "greedy_equal": len(equal), "greedy_gave_up": len(gave_up), "lost": len(lost),
        "diverged": {"faults": sum(inside(o) for o in diverged), "clean": sum(not inside(o) for o in diverged)},
        "hung": sum(o.hung for o in outcomes),
        "bad": len(bad), "bad_wrong": len(bad_wrong),
        "disconnects": sum(o.kind == "disconnect" for o in outcomes),
        "faults": [asdict(f) for f in faults],
        "fault_errors": [f"{f.kind}/{f.role}: {f.error}" for f in faults if f.error],
        "ttft_p50_s": {"faults": _pct(ttft_in, 0.5), "clean": _pct(ttft_out, 0.5)},
        "ttft_p99_s": {"faults": _pct(ttft_in, 0.99), "clean": _pct(ttft_out, 0.99)},
        "tpot_p50_s": {"faults": _pct(tpot_in, 0.5), "clean": _pct(tpot_out, 0.5)},
        "tpot_p99_s": {"faults": _pct(tpot_in, 0.99), "clean": _pct(tpot_out, 0.99)},
        "lost_examples": [asdict(o) | {"want": references[o.prompt]} for o in lost[:3]],
        "diverged_examples": [asdict(o) | {"want": references[o.prompt]} for o in diverged[:2]],
        "bad_wrong_examples": [asdict(o) for o in bad_wrong[:3]],
        **extra,
    }
    return figures


def violations(figures: dict, rss_growth_limit_mb: float) -> list[str]:
    """What the soak must never see, as sentences (empty when it passed)."""
    found = []
    for key in ("hung", "lost", "bad_wrong", "pages_leaked", "replica_restarts"):
        if figures[key]:
            found.append(f"{key}: {figures[key]}")
    found += figures["fault_errors"]
    missed = [f"{f['kind']}/{f['role']}" for f in figures["faults"] if not f["hits"]]
    if missed:
        found.append(f"faults that hit nothing: {missed}")
    capturing = [f for f in figures["faults"] if f["kind"] == "kill_capturing"]
    if any(f["hits"][-1]["phase"] != "capturing" for f in capturing if f["hits"]):
        found.append(f"kill_capturing hit a group outside its capture: {[f['hits'] for f in capturing]}")
    if figures["rss_growth_mb"] > rss_growth_limit_mb:
        found.append(f"replica RSS grew {figures['rss_growth_mb']:.0f} MiB (limit {rss_growth_limit_mb:.0f})")
    return found


# ----- one soak -----

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
            health = await _health(session, base)
            usage = await kv_usage(session, base)
            if set((health.get("groups") or {}).values()) == {"ready"} and usage and not any(usage.values()):
                break
            await asyncio.sleep(0.5)
        return usage


def soak(base: str, spec: LoadSpec, faults: list[Fault], stop_s: float, text_check: str = "exact") -> dict:
    """Run the load with the faults against the app at ``base`` (already healthy); the figures.

    ``text_check``: how a greedy answer is judged, ``exact`` or ``complete`` (module docstring)."""
    refs = asyncio.run(references(base, spec))
    pid = replica_pid()
    rss_start = rss_mb(pid)
    t0 = time.monotonic()
    injector = FaultInjector(base, faults, t0, stop_s)
    injector.start()
    outcomes = asyncio.run(run_load(base, spec))
    injector.join(timeout=injector.wait_s * 2)
    usage = asyncio.run(settle(base))
    try:
        pid_after = replica_pid()
    except RuntimeError:
        pid_after = None
    extra = {
        "duration_s": round(time.monotonic() - t0, 1), "rate": spec.rate,
        "pages_leaked": {g: u for g, u in usage.items() if u} or (0 if usage else "no kv_cache_usage_ratio"),
        "replica_restarts": 0 if pid_after == pid else f"replica pid {pid} -> {pid_after}",
        "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_mb(pid), 1) if pid_after == pid else None,
    }
    extra["rss_growth_mb"] = (extra["rss_end_mb"] or rss_start) - rss_start
    return summarize(outcomes, refs, injector.records, extra, spec.max_tokens, text_check)


def print_summary(figures: dict) -> None:
    keys = ("text_check", "requests", "greedy", "greedy_complete", "greedy_equal", "greedy_gave_up", "lost",
            "diverged", "hung", "bad", "bad_wrong",
            "disconnects", "pages_leaked", "replica_restarts", "rss_start_mb", "rss_growth_mb")
    for k in keys:
        print(f"{k:>18}: {figures[k]}")
    for f in figures["faults"]:
        hits = ", ".join(f"{h['signal']} {h['actor']} ({h['phase']})" for h in f["hits"])
        took = f"ready again after {f['ready_again'] - f['at']:.1f}s" if f["ready_again"] else f"error {f['error']}"
        print(f"  fault {f['kind']}/{f['role']}: {hits}; {took}")
    for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        print(f"{k:>18}: {figures[k]}")


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


def main(argv: list[str] | None = None) -> int:
    from bench.common import environment, write_results
    from bench.engine import ensure_checkpoint
    from bench.serve import start_app, wait_healthy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity to send")
    ap.add_argument("--rate", type=float, help="requests per second (default: --load x measured capacity)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--step-timeout-s", type=float, default=5.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--cpu", action="store_true", help="the CPU soak config (tests/test_soak.py's)")
    ap.add_argument("--text-check", choices=TEXT_CHECKS,
                    help="how a greedy answer is judged (default: exact on the CPU, complete on a GPU)")
    args = ap.parse_args(argv)

    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    path = ensure_checkpoint("tiny-llama" if cpu else args.preset, Path(args.checkpoints))
    overrides = (CPU_OVERRIDES if cpu else
                 ["cluster.mode=disaggregated", "cluster.gpus_per_rank=0.5", "cache.gpu_memory_fraction=0.4",
                  "cluster.kv_transport=cuda_ipc", "cluster.lost_after_s=300", "cluster.start_timeout_s=600",
                  "serve.stream_batching_interval_ms=0"])
    overrides = [*overrides, f"cluster.step_timeout_s={args.step_timeout_s}", "serve.request_timeout_s=120",
                 *args.set]
    base = start_app(path, overrides, "soak", fleet_name=FLEET)
    wait_healthy(base, 900)
    spec = LoadSpec("soak", make_prompts(16), args.max_tokens, 1.0, args.duration_s, 120.0)
    capacity = measure_capacity(base, spec)
    rate = args.rate or args.load * capacity
    spec = LoadSpec("soak", spec.prompts, args.max_tokens, rate, args.duration_s, 120.0)
    text_check = args.text_check or ("exact" if cpu else "complete")
    figures = soak(base, spec, default_faults(args.duration_s), args.step_timeout_s + 3, text_check)
    figures["capacity_rps"] = capacity
    print_summary(figures)
    found = violations(figures, rss_growth_limit_mb=1024)
    print("violations:", found or "none")
    write_results("soak", {"environment": environment(), "config": overrides, "figures": figures,
                           "violations": found})
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
