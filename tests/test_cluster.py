"""Tensor-parallel worker groups as real Ray actors on CPU (gloo), through the debug runner path."""

from __future__ import annotations

import time

import pytest
import ray  # noqa: E402 - a hard requirement: the cluster tests must not skip
import torch

from cluster.group import WorkerGroup  # noqa: E402
from cluster.rank import GroupState  # noqa: E402
from deploy.config import load_config  # noqa: E402
from tests.reference import rel_err  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.model.linear import qkv_sources  # noqa: E402
from worker.model.parallel import TensorParallel  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402
from worker.step_message import StepMessage  # noqa: E402
from worker.worker import Worker  # noqa: E402

#: Logical CPUs of the module's local Ray (the ``ray_local`` fixture in conftest.py).
RAY_CPUS = 6


def _config(path, tp, *extra):
    return load_config(None, [f"model.path={path}", "model.device=cpu", "graphs.debug=true", "cache.num_pages=128",
                              "scheduler.max_running_requests=8", "scheduler.chunked_prefill_size=512",
                              "graphs.prefill.max_tokens=512", "graphs.decode.max_batch_size=8",
                              f"cluster.tp_size={tp}", "cluster.step_timeout_s=60", "cluster.start_timeout_s=240",
                              *extra])


def test_kv_heads_replicated_when_tp_exceeds_them():
    sources, q_heads, kv_heads = qkv_sources("l", 8, 2, 16, TensorParallel(3, 4))
    assert (q_heads, kv_heads) == (2, 1)
    assert sources[1].start == 1 * 16 and sources[1].length == 16  # ranks 2, 3 share kv head 1


def _messages(prompts, pages_per_row=4):
    """A prefill of ``prompts`` returning every token's logits, and a decode message factory."""
    tables = [list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)) for i in range(len(prompts))]
    ids = [t for p in prompts for t in p]
    pos = [i for p in prompts for i in range(len(p))]
    rows = list(range(len(ids)))
    greedy = SamplingParams(temperature=0)
    prefill = StepMessage(True, ids, pos, [len(p) for p in prompts], [len(p) for p in prompts], tables, rows,
                          [greedy] * len(rows), [0] * len(rows), [0] * len(rows), return_logits=True)

    def decode(tokens, lengths):
        return StepMessage(False, tokens, [n - 1 for n in lengths], lengths, [1] * len(lengths), tables,
                           list(range(len(lengths))), [greedy] * len(lengths), [0] * len(lengths),
                           [0] * len(lengths), return_logits=True)

    return prefill, decode


@pytest.mark.timeout(600)
def test_tp2_group_logits_equal_tp1(ray_local, checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    local = Worker.local(_config(path, 1))
    group = WorkerGroup(_config(path, 2))
    try:
        assert group.state is GroupState.READY and group.num_pages == local.num_pages
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (7, 30, 19)]
        prefill, decode = _messages(prompts)
        ref, got = local.execute(prefill), group.execute(prefill)
        assert rel_err(got.logits, ref.logits) <= 1e-5
        last = [sum(len(p) for p in prompts[:i + 1]) - 1 for i in range(len(prompts))]
        tokens = [ref.token_ids[i] for i in last]
        lengths = [len(p) + 1 for p in prompts]
        for _ in range(16):
            ref, got = local.execute(decode(tokens, lengths)), group.execute(decode(tokens, lengths))
            assert rel_err(got.logits, ref.logits) <= 1e-5
            assert got.token_ids == ref.token_ids
            tokens, lengths = ref.token_ids, [n + 1 for n in lengths]
        # every rank replayed through the debug runner (not the plain eager path)
        text = ray.get(group.rank_actors()[1].metrics_text.remote(), timeout=30).decode()
        assert 'cuda_graph_fallbacks_total{group="g0",phase="decode",rank="1",reason="debug",role="colocated"} 16.0' \
            in text
    finally:
        group.shutdown()


@pytest.mark.timeout(600)
def test_killed_rank_fails_group_restarts_and_requests_complete(ray_local, checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11] * 17, [300, 301, 302]]
    expected = [o.token_ids for o in Engine(_config(path, 1)).generate(prompts, params)]

    group = WorkerGroup(_config(path, 2))
    engine = Engine(_config(path, 2), executor=group)
    start_free = engine.num_free_pages
    started = time.monotonic()
    try:
        ids = [engine.add_request(p, params) for p in prompts]
        for _ in range(4):
            engine.step()
        victim = group.rank_actors()[1]
        ray.kill(victim, no_restart=True)
        assert engine.step() == []  # the step failed: requests were re-queued, not lost
        assert group.restarts == 1 and group.health()["generation"] == 1
        assert "rank died" in group.last_error
        while engine.has_unfinished():
            engine.step()
            assert time.monotonic() - started < 400
        assert group.state is GroupState.READY
        assert [engine.output(i).token_ids for i in ids] == expected
        assert all(engine.output(i).num_preemptions == 1 for i in ids)
        assert engine.num_free_pages == start_free
        again = engine.generate([prompts[0]], params)[0]
        assert again.token_ids == expected[0] and again.finish_reason == "length"
    finally:
        group.shutdown()


def _wait_until_frozen(actor, within_s: float = 30.0) -> None:
    """Return once the stopped actor no longer answers a ping.

    Some sandboxes apply a group stop only when a thread next enters the kernel, so a rank
    spinning on its compiled-graph channel may still finish one more step after ``kill`` returns.
    """
    from ray.exceptions import GetTimeoutError

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=1.0)
        except GetTimeoutError:
            return
        time.sleep(0.2)
    raise AssertionError(f"the SIGSTOPped rank still answered pings after {within_s}s")


@pytest.mark.timeout(300)
def test_stuck_rank_times_out_the_step_and_the_group_recovers(ray_local, checkpoint_dir):
    """A rank frozen mid-generation (SIGSTOP: alive, silent): the compiled-graph step times out
    after cluster.step_timeout_s, the group is killed (teardown cannot wait on the frozen rank)
    and restarted, and the requests still finish with the right tokens."""
    import os
    import signal

    path = checkpoint_dir("tiny-llama")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [300, 301, 302]]
    expected = [o.token_ids for o in Engine(_config(path, 1)).generate(prompts, params)]
    cfg = _config(path, 1, "cluster.step_timeout_s=3")
    group = WorkerGroup(cfg)
    engine = Engine(cfg, executor=group)
    try:
        ids = [engine.add_request(p, params) for p in prompts]
        engine.step()
        rank = group.rank_actors()[0]
        pid = ray.get(rank.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        _wait_until_frozen(rank)
        started = time.monotonic()
        events = engine.step()
        if events:  # async scheduling: the step sent before the freeze lands first
            events = engine.step()
        assert events == []  # timed out: requests re-queued
        assert time.monotonic() - started < 3 + 5 + 20, "failing the stuck group took too long"
        assert "step exceeded cluster.step_timeout_s=3" in group.last_error
        while engine.has_unfinished():
            engine.step()
            assert time.monotonic() - started < 240
        assert [engine.output(i).token_ids for i in ids] == expected
        assert group.restarts == 1 and group.state is GroupState.READY
    finally:
        group.shutdown()


@pytest.mark.timeout(300)
def test_group_that_cannot_be_placed_reports_its_wait_then_fails_with_a_reason(ray_local, checkpoint_dir, caplog):
    """2 ranks x 4 CPUs on a 6-CPU Ray: the group says within seconds that it waits for resources,
    with what it asked for and what is free (the log says it once), then fails at
    cluster.start_timeout_s naming both."""
    import logging
    import threading

    from cluster.rank import GroupUnavailable, PlacementWait

    path = checkpoint_dir("tiny-llama")
    seen: list[tuple[float, object, PlacementWait | None]] = []
    caplog.set_level(logging.INFO, logger="cluster.generation")
    started = time.monotonic()
    with pytest.raises(GroupUnavailable, match=r"placement group for 2 ranks x \{'CPU': 4.0\} not ready after 6s: "
                                               r"the cluster lacks those resources \(\{'CPU': [0-9.]+\} free\)"):
        WorkerGroup(_config(path, 2, "cluster.cpus_per_rank=4", "cluster.start_timeout_s=6"),
                    on_state=lambda gid, state, waiting: seen.append((time.monotonic() - started, state, waiting)))
    assert time.monotonic() - started < 30
    waits = [(t, w) for t, state, w in seen if w is not None]
    assert waits and waits[0][0] < 3, seen  # reported within seconds, not at the timeout
    assert all(state is GroupState.STARTING for _, state, w in seen if w is not None)
    assert len(waits) >= 3, "the wait is refreshed about every second"
    health = waits[-1][1].health(time.monotonic())
    assert health["state"] == "waiting for resources"
    assert health["asked"] == {"bundle": {"CPU": 4.0}, "count": 2}
    assert 0 <= health["available"]["CPU"] <= 6 and health["waiting_s"] > 3
    said = [r.getMessage() for r in caplog.records if "waiting for resources" in r.getMessage()]
    assert len(said) == 1 and "asks 2 x {'CPU': 4.0}" in said[0] and "free" in said[0], said

    # A cancelled start ends at its next look instead of at the timeout.
    stop = threading.Event()
    timer = threading.Timer(1.5, stop.set)
    timer.start()
    started = time.monotonic()
    with pytest.raises(GroupUnavailable, match="start cancelled while waiting for resources"):
        WorkerGroup(_config(path, 2, "cluster.cpus_per_rank=4", "cluster.start_timeout_s=120"), cancel=stop)
    assert time.monotonic() - started < 10
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"
                and pg["name"].startswith("graphfleet-g0-")], "the cancelled group's placement group is left"


def test_a_cpu_rank_reserves_its_cpu_share_and_a_bundle_is_never_empty(ray_local, checkpoint_dir):
    from configkit import ConfigError

    group = WorkerGroup(_config(checkpoint_dir("tiny-llama"), 1, "cluster.cpus_per_rank=0.5"), group_id="share")
    try:
        [pg] = [pg for pg in ray.util.placement_group_table().values()
                if pg["name"] == "graphfleet-share-0" and pg["state"] == "CREATED"]
        assert list(pg["bundles"].values()) == [{"CPU": 0.5}]
    finally:
        group.shutdown()
    with pytest.raises(ConfigError, match="cluster.cpus_per_rank: must be > 0"):
        _config(checkpoint_dir("tiny-llama"), 1, "cluster.cpus_per_rank=0")
