"""The fleet on a real local Ray (CPU, gloo, debug runner path): hand-off, routing, failures (its
pieces without Ray are tests/test_fleet_parts.py, faults that need a fleet of their own
tests/test_fleet_faults.py).

Outputs are compared token for token with the in-process :class:`Engine` on the same checkpoint.
Fleets are module-scoped and shared by the tests that need the same layout.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray  # noqa: E402 - a hard requirement: the cluster tests must not skip
import torch

from deploy.config import load_config  # noqa: E402
from fleet.fleet import Fleet  # noqa: E402
from fleet.router import Overloaded  # noqa: E402
from tests.fleet_probes import fleet_group, group_ids  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.outputs import FailureKind  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _config(path, *extra):
    return load_config(None, [f"model.path={path}", "model.device=cpu", "graphs.debug=true", "cache.num_pages=128",
                              "scheduler.max_running_requests=8", "scheduler.chunked_prefill_size=512",
                              "graphs.prefill.max_tokens=512", "graphs.decode.max_batch_size=8",
                              "cluster.step_timeout_s=60", "cluster.start_timeout_s=120", *extra])


def _prompts(n, seed=0, lo=3, hi=60):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(10, 1000, (k,), generator=g).tolist() for k in lengths]


def _wait_until(predicate, timeout_s, what):
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.02)


def _pages_back(fleet):
    groups = fleet.health()["groups"]
    return all(g["free_pages"] == g["num_pages"] and g["requests"] == 0 for g in groups.values())


def _collect(stream):
    """Consume a stream: (token ids, text, final event)."""
    tokens, text, last = [], "", None
    for ev in stream:
        tokens += ev.token_ids
        text += ev.text
        last = ev
    return tokens, text, last


#: Logical CPUs of the module's local Ray (the ``ray_local`` fixture in conftest.py).
RAY_CPUS = 16


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return checkpoint_dir("tiny-llama")


@pytest.fixture(scope="module")
def reference(path):
    """``reference(prompts, params)`` -> outputs of the in-process engine."""
    # One intra-op thread, like the rank actors: on a busy 2-core machine two threads oversubscribe
    # the cores and the in-process reference runs an order of magnitude slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(_config(path))
    yield lambda prompts, params=GREEDY: engine.generate(prompts, params)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def disagg(ray_local, path):
    """1 prefill + 1 decode group; the decode group schedules asynchronously (steps in flight
    while KV imports, aborts and group failures happen), the prefill group cannot."""
    fleet = Fleet.start(_config(path, "scheduler.async_scheduling=true"), mode="disaggregated", name="dis",
                        max_waiting_requests=64)
    yield fleet
    fleet.shutdown()


# ----- equality with the in-process engine -----

def test_colocated_matches_engine(ray_local, path, reference):
    prompts = _prompts(6, seed=1)
    with Fleet.start(_config(path), name="colo") as fleet:
        groups = fleet.health()["groups"]
        assert list(groups) == ["colo-c0"]
        # how long each phase of the group's start took (the log line at ready says the same)
        seconds = groups["colo-c0"]["start_seconds"]
        assert list(seconds) == ["placement", "rendezvous", "load", "allocate", "capture"]
        assert all(v >= 0 for v in seconds.values()) and seconds["load"] > 0 and seconds["capture"] > 0
        outs = fleet.generate(prompts, GREEDY, timeout_s=120)
    for got, want in zip(outs, reference(prompts)):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "length")


@pytest.mark.timeout(180)
def test_disaggregated_matches_engine_greedy_and_seeded(disagg, reference):
    health = disagg.health()
    assert health["status"] == "ready"
    assert {s.role: s.group.config.scheduler.async_scheduling for s in disagg.members} == \
        {"prefill": False, "decode": True}
    assert {g: v["role"] for g, v in health["groups"].items()} == {"dis-p0": "prefill", "dis-d0": "decode"}
    prompts = _prompts(6, seed=2)
    outs = disagg.generate(prompts, GREEDY, timeout_s=120)
    for got, want in zip(outs, reference(prompts)):
        assert (got.token_ids, got.text, got.finish_reason, got.error) == (want.token_ids, want.text, "length", None)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=1234, ignore_eos=True, logprobs=True)
    got, want = disagg.generate(prompts[:3], seeded, timeout_s=120), reference(prompts[:3], seeded)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.logprobs) == 10 for o in got)
    assert [x for o in got for x in o.logprobs] == pytest.approx([x for o in want for x in o.logprobs], abs=1e-4)

    async def consume():
        return [ev async for ev in disagg.astream(prompts[0], GREEDY, timeout_s=60)]

    events = asyncio.run(consume())
    assert [t for ev in events for t in ev.token_ids] == outs[0].token_ids and events[-1].finished
    assert [ev.finished for ev in events].count(True) == 1


def test_each_group_runs_its_engine_loop_in_its_leader_process(disagg):
    """The scheduler lives beside rank 0: every group's engine loop runs in its leader's process,
    none in the fleet's."""
    import os

    def where(actor):
        host = actor.host
        return os.getpid(), host is not None and host.running, host.engine.tokenizer is not None

    for gid in group_ids(disagg):
        pid, running, detokenizes = ray.get(fleet_group(disagg, gid).rank_actors()[0].__ray_call__.remote(where),
                                            timeout=30)
        assert pid != os.getpid() and running and detokenizes, gid
    assert disagg.tokenizer is not None  # the fleet's own, for text prompts


@pytest.mark.timeout(240)
def test_tp2_prefill_and_tp2_decode_match_engine(ray_local, path, reference):
    prompts = _prompts(5, seed=3)
    with Fleet.start(_config(path), mode="disaggregated", prefill_tp_size=2, decode_tp_size=2, name="tp2") as fleet:
        assert {v["tp_size"] for v in fleet.health()["groups"].values()} == {2}
        outs = fleet.generate(prompts, GREEDY, timeout_s=120)
        # penalties and alternatives cross the hand-off and reach every rank in the step message
        controlled = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, logprobs=True,
                                    top_logprobs=3, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3,
                                    prompt_logprobs=2)
        got = fleet.generate(prompts[:3], controlled, timeout_s=120)
        _wait_until(lambda: _pages_back(fleet), 30, "pages back on both tp2 groups")
    for o, want in zip(outs, reference(prompts)):
        assert o.token_ids == want.token_ids and o.text == want.text
    want = reference(prompts[:3], controlled)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [ids for o in got for _, ids, _ in o.logprobs] == [ids for o in want for _, ids, _ in o.logprobs]
    assert [lp for o in got for lp, _, _ in o.logprobs] == pytest.approx(
        [lp for o in want for lp, _, _ in o.logprobs], abs=1e-4)
    for o, w in zip(got, want):  # the prefill group's prompt log-probabilities reach the client
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids) - 1
        assert [ids for _, ids, _ in o.prompt_logprobs] == [ids for _, ids, _ in w.prompt_logprobs]
        assert [lp for lp, _, _ in o.prompt_logprobs] == pytest.approx([lp for lp, _, _ in w.prompt_logprobs],
                                                                       abs=1e-4)


# ----- concurrency and the router -----

@pytest.mark.timeout(240)
def test_64_concurrent_streams_complete_and_pages_return(disagg, reference):
    prompts = _prompts(64, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in reference(prompts, params)]
    start = disagg.health()["groups"]
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda p: _collect(disagg.stream(p, params, timeout_s=180, wait_s=120)), prompts))
    assert [r[0] for r in results] == expected
    assert all(r[2].finished and r[2].finish_reason == "length" for r in results)
    _wait_until(lambda: _pages_back(disagg), 30, "every page back after 64 streams")
    end = disagg.health()["groups"]
    assert {g: v["free_pages"] for g, v in end.items()} == {g: v["free_pages"] for g, v in start.items()}


@pytest.mark.timeout(180)
def test_router_overload_deadline_and_abort_free_pages(disagg):
    long = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
    prompt = _prompts(1, seed=5)[0]
    # Overload: the queue holds 64 new requests; a few more are taken by the groups meanwhile.
    handles = []
    with pytest.raises(Overloaded, match=r"fleet overloaded: 64 requests already waiting for a group "
                                         r"\(scheduler\.max_waiting_requests=64\); retry later"):
        for _ in range(200):
            handles.append(disagg.submit(prompt, long, timeout_s=120))
    assert 64 <= len(handles) <= 64 + 3 * 8
    with pytest.raises(Overloaded):
        disagg.stream(prompt, long)  # raises at the call, before any iteration
    assert all(h.abort() for h in handles)
    assert {h.result(wait_s=60).finish_reason for h in handles} == {"abort"}
    _wait_until(lambda: _pages_back(disagg), 30, "pages back after aborting the overload")

    # Deadline: the request ends with a clear error and its pages are freed.
    out = disagg.submit(prompt, long, timeout_s=1.0).result(wait_s=60)
    assert out.finish_reason == "error"
    assert out.error.startswith("deadline exceeded: not finished 1s after submission (")
    assert out.failure is FailureKind.DEADLINE
    _wait_until(lambda: _pages_back(disagg), 30, "pages back after a deadline")

    # Abort while decoding: the decode group held its pages until then.
    handle = disagg.submit(prompt, long, timeout_s=120)
    events = handle.events(wait_s=60)
    for _ in range(3):
        next(events)
    assert disagg.health()["groups"]["dis-d0"]["requests"] == 1
    assert handle.abort()
    assert handle.result(wait_s=60).finish_reason == "abort"
    _wait_until(lambda: _pages_back(disagg), 30, "pages back on both sides after abort in decode")
    # Abort right away (prefill of a long prompt, or its hand-off): both sides still end clean.
    handle = disagg.submit(_prompts(1, seed=6, lo=1200, hi=1300)[0], long, timeout_s=120)
    assert handle.abort()
    assert handle.result(wait_s=60).finish_reason == "abort"
    _wait_until(lambda: _pages_back(disagg), 30, "pages back on both sides after abort in prefill")
    assert not disagg.abort("no-such-request")


# ----- failures -----

def _open_streams(fleet, prompts, params):
    """Start one consumer thread per prompt; returns (threads, results by index)."""
    results: dict[int, tuple] = {}
    progress = [0] * len(prompts)

    def consume(i):
        tokens, last = [], None
        for ev in fleet.stream(prompts[i], params, timeout_s=240, wait_s=180):
            tokens += ev.token_ids
            progress[i] = len(tokens)
            last = ev
        results[i] = (tokens, last)

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results, progress


def _join(threads, timeout_s):
    end = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.1, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a stream hung"


def _watch_health(fleet, stop):
    seen = set()

    def poll():
        while not stop.is_set():
            h = fleet.health()
            seen.add(h["status"])
            seen.update(f"{g}:{v['state']}" for g, v in h["groups"].items())
            time.sleep(0.01)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    return seen, t


@pytest.mark.timeout(240)
@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_killed_group_requests_complete_after_restart(disagg, reference, role):
    prompts = _prompts(16, seed=7 if role == "decode" else 8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in reference(prompts, params)]
    gid = "dis-d0" if role == "decode" else "dis-p0"
    group = fleet_group(disagg, gid)
    restarts = group.restarts
    victim = group.rank_actors()[0]
    stop = threading.Event()
    seen, poller = _watch_health(disagg, stop)
    threads, results, progress = _open_streams(disagg, prompts, params)
    if role == "decode":  # kill once requests are decoding on it
        _wait_until(lambda: sum(p >= 2 for p in progress) >= 4, 60, "streams decoding")
    ray.kill(victim, no_restart=True)
    _join(threads, 200)
    # The next request needs the group (recovered by now, or restarting): it succeeds.
    again = disagg.generate([prompts[0]], params, timeout_s=120)[0]
    stop.set()
    poller.join(5)
    completed = [i for i, (tokens, last) in results.items() if last.finish_reason == "length"]
    failed = [i for i, (tokens, last) in results.items() if last.finish_reason == "error"]
    assert len(results) == 16 and len(completed) == 16 and failed == []
    assert [results[i][0] for i in range(16)] == expected
    assert again.token_ids == expected[0] and again.error is None
    assert group.restarts == restarts + 1
    assert "rank died" in group.last_error
    assert f"{gid}:degraded" in seen and "degraded" in seen
    _wait_until(lambda: disagg.health()["status"] == "ready" and _pages_back(disagg), 60, "fleet ready again")


@pytest.mark.timeout(240)
def test_decode_rank_killed_while_idle_fails_the_group_at_the_next_hand_off(disagg, reference):
    """No step notices the death of an idle decode group's rank; the first KV import into it does,
    and must fail the group (which restarts) instead of re-prefilling every request into it."""
    prompts = _prompts(6, seed=11)
    expected = [o.token_ids for o in reference(prompts)]
    _wait_until(lambda: disagg.health()["status"] == "ready" and _pages_back(disagg), 60, "an idle fleet")
    group = fleet_group(disagg, "dis-d0")
    restarts = group.restarts
    ray.kill(group.rank_actors()[0], no_restart=True)
    outputs = disagg.generate(prompts, GREEDY, timeout_s=180)
    assert [o.token_ids for o in outputs] == expected and all(o.error is None for o in outputs)
    assert group.restarts == restarts + 1 and "died" in group.last_error
    _wait_until(lambda: disagg.health()["status"] == "ready" and _pages_back(disagg), 60, "fleet ready again")


# ----- graceful shutdown -----

@pytest.mark.timeout(240)
def test_drain_finishes_short_requests_aborts_long_ones_and_releases_every_group(ray_local, path):
    from fleet.fleet import FleetClosed, FleetDraining

    fleet = Fleet.start(_config(path), mode="disaggregated", name="drn")
    pg_names = {f"graphfleet-{s.group_id}-0" for s in fleet.members}
    rank_names = [f"graphfleet-{s.group_id}-0-rank0" for s in fleet.members]
    prompt = _prompts(1, seed=12)[0]
    short = fleet.submit(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    long = fleet.submit(prompt, SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True))
    events = long.events(wait_s=60)
    next(events)  # both are running: the long one has its first token
    refused = []

    def submit_while_draining():
        _wait_until(lambda: fleet.draining, 10, "the drain to begin")
        try:
            fleet.submit(prompt, GREEDY)
        except FleetDraining as e:
            refused.append(str(e))

    t = threading.Thread(target=submit_while_draining)
    t.start()
    started = time.monotonic()
    report = fleet.drain(3.0)
    elapsed = time.monotonic() - started
    t.join(10)
    assert refused and "draining" in refused[0]
    assert (report.finished, report.aborted) == (1, 1) and 3.0 <= report.seconds <= elapsed < 30
    out = short.result(wait_s=10)
    assert out.finish_reason == "length" and len(out.token_ids) == 20 and out.error is None
    out = long.result(wait_s=10)
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 1500
    assert out.error == "the server is shutting down: the request did not finish within the drain timeout (3s)"
    assert fleet.health()["status"] == "stopped"
    with pytest.raises(FleetClosed, match="not accepting requests"):  # once shut down
        fleet.submit(prompt, GREEDY)
    assert fleet.drain(3.0).seconds == 0.0  # nothing left to do
    live = [pg for pg in ray.util.placement_group_table().values() if pg["name"] in pg_names
            and pg["state"] != "REMOVED"]
    assert live == [], live
    for name in rank_names:
        with pytest.raises(ValueError):
            ray.get_actor(name)
