"""A decode group's leader fetches a hand-off's KV off its engine loop: the other requests keep
decoding while the shards are on their way, and the request joins with exactly its KV.

In process on the CPU: a real engine host over a real worker, a real Ray object store holding the
shard (produced by a task that takes its time, as a fetch of a large shard does), the real
``resolve_shards`` and page import.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import ray

from cluster.engine_host import EngineHost
from cluster.group_messages import Abort, Admit, Prefilled
from cluster.kv_transport import resolve_shards
from cluster.step_channel import LeaderExecutor
from deploy.config import load_config
from worker import kv_pages
from worker.engine import Engine
from worker.sampling.params import SamplingParams
from worker.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPT = [11, 57, 300, 42, 9, 810, 77, 5, 123, 64, 31, 999, 8, 250, 17, 88, 430, 12]


@ray.remote(num_cpus=0)
def _slowly(payload, delay_s: float):
    time.sleep(delay_s)
    return payload


#: Logical CPUs of the module's local Ray (the ``ray_local`` fixture in conftest.py).
RAY_CPUS = 4


@pytest.fixture(scope="module")
def config(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    return load_config(None, [f"model.path={path}", "model.device=cpu", "attention.backend=torch",
                              "graphs.enabled=false", "cache.num_pages=256",
                              "scheduler.async_scheduling=false"])


def _handed_off(config):
    """The prompt's first greedy token and its KV (a host tensor), as a prefill group exports them,
    and the greedy tokens of the whole request run in one engine (the reference)."""
    reference = Engine(config)
    rid = reference.add_request(PROMPT, GREEDY)
    expected = []
    while reference.has_unfinished():
        for ev in reference.step():
            if ev.request_id == rid:
                expected += ev.token_ids
    prefill = Engine(config)
    exported = {}

    def stage(req):
        exported["kv"] = kv_pages.export_pages(prefill.worker, req.pages[:], to_host=True)

    prefill.admit(PROMPT, GREEDY, seed=0, request_id="h", on_first_token=stage)
    first = []
    while prefill.has_unfinished():
        for ev in prefill.step():
            first += ev.token_ids
    return first, exported["kv"], expected


@contextlib.contextmanager
def _running_host(config):
    """A decode group's engine host over a local worker, its loop on a thread of its own."""
    worker = Worker.local(config)

    def import_shard(pages, transport, item):
        kv_pages.import_pages(worker, pages, item)

    host = EngineHost(config, LeaderExecutor(worker, None), "decode", worker.max_len, lambda *a: None,
                      resolve_shards, import_shard)
    thread = threading.Thread(target=host.run, daemon=True)
    thread.start()
    try:
        yield host
    finally:
        host.stop()
        thread.join(10)


def _tokens_by_request(host, until, timeout_s: float = 60.0) -> dict[str, list]:
    """(time, tokens) per request from the host's reports until ``until(seen)`` holds."""
    seen: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while not until(seen):
        assert time.monotonic() < deadline, f"timed out; seen {({k: len(v) for k, v in seen.items()})}"
        report = host.take_report(0.5)
        assert report.loop_error is None, report.loop_error
        now = time.monotonic()
        for ev in report.events:
            seen.setdefault(ev.request_id, []).append((now, ev.token_ids, ev.finish_reason))
        for r in report.refused:
            seen.setdefault(r.engine_id, []).append((now, [], f"refused: {r.kind} {r.message}"))
        for eid in report.accepted:
            seen.setdefault(eid, []).append((now, [], "accepted"))
    return seen


def test_other_requests_decode_while_a_hand_off_fetches_its_kv(ray_local, config):
    first, kv, expected = _handed_off(config)
    assert first == expected[:1]
    with _running_host(config) as host:
        busy = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
        host.put(1, [Admit("busy#0", PROMPT[:8], busy, 1, [], [], False)])
        _tokens_by_request(host, lambda seen: len(seen.get("busy#0", [])) >= 3)

        delay_s = 2.0
        shard = _slowly.remote(kv, delay_s)
        sent = time.monotonic()
        host.put(2, [Prefilled("h#0", PROMPT, first, GREEDY, 0, [], "object_store", (shard,), 30.0)])
        seen = _tokens_by_request(host, lambda seen: any(e[2] == "length" for e in seen.get("h#0", [])))

        during = [t for t, toks, _ in seen["busy#0"] if sent + 0.2 < t < sent + delay_s - 0.2 and toks]
        assert len(during) >= 5, "the busy request stalled while the hand-off's KV was fetched"
        accepted = [t for t, _, what in seen["h#0"] if what == "accepted"]
        assert accepted and accepted[0] >= sent + delay_s - 0.1
        tokens = [tok for _, toks, _ in seen["h#0"] for tok in toks]
        assert first + tokens == expected  # its KV arrived whole: greedy decoding goes on as in one engine


def test_a_hand_off_aborted_while_its_kv_is_on_the_way_is_never_admitted(ray_local, config):
    first, kv, _ = _handed_off(config)
    with _running_host(config) as host:
        usable, page = host.engine.allocator.num_usable, config.cache.page_size
        shard = _slowly.remote(kv, 1.5)
        host.put(1, [Prefilled("gone#0", PROMPT, first, GREEDY, 0, [], "object_store", (shard,), 30.0)])
        deadline = time.monotonic() + 5.0
        while (load := host.take_report(0.2).load) is None or load.requests == 0:
            assert time.monotonic() < deadline, "the fetch in progress never showed in the load"
        # Its slot, pages and tokens to come count as taken while its KV is on the way.
        assert load.requests == 1 and load.free_pages == usable - -(-len(PROMPT) // page)
        assert load.outstanding_tokens == GREEDY.max_tokens - len(first)
        host.put(2, [Abort("gone#0")])
        time.sleep(2.0)  # the fetch has finished by now
        report = host.take_report(0.5)
        assert "gone#0" not in report.accepted and not report.events and not report.refused
        assert host.engine.requests.get("gone#0") is None
        assert report.load.requests == 0 and report.load.free_pages == usable


def test_shards_that_never_arrive_refuse_the_hand_off(ray_local, config):
    first, kv, _ = _handed_off(config)
    shard = _slowly.remote(kv, 30.0)
    try:
        with _running_host(config) as host:
            host.put(1, [Prefilled("late#0", PROMPT, first, GREEDY, 0, [], "object_store", (shard,), 0.5)])
            seen = _tokens_by_request(host, lambda seen: "late#0" in seen, timeout_s=10.0)
            (what,) = [w for _, _, w in seen["late#0"]]
            assert what.startswith("refused: transfer_failed") and "not available after 0.5s" in what
            assert host.engine.requests.get("late#0") is None
    finally:
        ray.cancel(shard, force=True)
