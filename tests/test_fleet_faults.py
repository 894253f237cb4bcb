# ruff: noqa: F811 - pytest fixtures imported from test_fleet are redefined as test parameters
"""Faults that take a group's fleet of its own (local Ray, CPU): a rank killed while its group's new
generation starts, and again while it captures (the fleet keeps serving on its other groups
meanwhile, and the group comes back; a restart killed while capturing is retried), and a decode
group that dies with no restart (its requests move to the other one, then end with a clear error)."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from fleet.fleet import Fleet
from tests.fleet_probes import fleet_group
from tests.test_fleet import (  # noqa: F401 - fixtures are used by name
    GREEDY,
    _config,
    _join,
    _open_streams,
    _pages_back,
    _prompts,
    _wait_until,
    path,
    reference,
)
from worker.outputs import FailureKind
from worker.sampling.params import SamplingParams

#: Logical CPUs of the module's local Ray (the ``ray_local`` fixture in conftest.py).
RAY_CPUS = 16


def _newest_rank0(prefix: str) -> str | None:
    names = [n for n in ray.util.list_named_actors() if n.startswith(prefix) and n.endswith("-rank0")]
    return max(names, key=lambda n: int(n.split("-")[-2]), default=None)


@pytest.mark.timeout(300)
def test_rank_killed_while_starting_and_while_capturing_the_fleet_serves_on_and_recovers(ray_local, path, reference):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = _prompts(12, seed=21)
    expected = [o.token_ids for o in reference(prompts, params)]
    killed: list[tuple[str, str]] = []  # (phase, actor name)
    kill_capture = threading.Event()

    def on_state(group_id, state, waiting):
        # Generation 2 of d1: killed as it reaches capture (before the capture call reaches it).
        if group_id != "flt-d1" or state.value != "capturing" or not kill_capture.is_set():
            return
        name = _newest_rank0("graphfleet-flt-d1-")
        if name and name.startswith("graphfleet-flt-d1-2-"):
            kill_capture.clear()
            killed.append(("capturing", name))
            ray.kill(ray.get_actor(name), no_restart=True)

    def kill_generation_1_while_it_starts():
        end = time.monotonic() + 120
        while time.monotonic() < end:
            name = _newest_rank0("graphfleet-flt-d1-")
            if name and name.startswith("graphfleet-flt-d1-1-"):
                killed.append(("starting", name))
                kill_capture.set()  # the next generation dies in capture
                ray.kill(ray.get_actor(name), no_restart=True)
                return
            time.sleep(0.01)

    with Fleet.start(_config(path), mode="disaggregated", num_decode_groups=2, name="flt",
                     on_group_state=on_state) as fleet:
        d1 = fleet_group(fleet, "flt-d1")
        killer = threading.Thread(target=kill_generation_1_while_it_starts, daemon=True)
        killer.start()
        threads, results, progress = _open_streams(fleet, prompts, params)
        _wait_until(lambda: sum(p >= 2 for p in progress) >= 4, 60, "streams decoding")
        ray.kill(d1.rank_actors()[0], no_restart=True)  # generation 0 dies mid-stream
        _join(threads, 200)
        killer.join(5)
        assert [phase for phase, _ in killed][:1] == ["starting"]
        # Every stream completed token for token: d0 and p0 served on while d1 kept dying.
        assert [results[i][0] for i in range(12)] == expected
        assert [results[i][1].finish_reason for i in range(12)] == ["length"] * 12
        # New requests are served while d1 restarts (or once it is back).
        more = fleet.generate(prompts[:3], params, timeout_s=120)
        assert [o.token_ids for o in more] == expected[:3] and all(o.error is None for o in more)
        _wait_until(lambda: fleet.health()["groups"]["flt-d1"]["state"] == "ready", 180, "d1 ready again")
        assert [phase for phase, _ in killed] == ["starting", "capturing"], killed
        assert d1.restarts == 3 and d1.generation == 3
        _wait_until(lambda: fleet.health()["status"] == "ready" and _pages_back(fleet), 60, "fleet ready again")
        # The recovered group takes hand-offs again.
        again = fleet.generate(prompts[3:9], params, timeout_s=120)
        assert [o.token_ids for o in again] == expected[3:9]


@pytest.mark.timeout(240)
def test_dead_decode_group_moves_requests_then_errors_when_none_is_left(ray_local, path, reference):
    prompts = _prompts(16, seed=9)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in reference(prompts, params)]
    with Fleet.start(_config(path, "cluster.restart=false"), mode="disaggregated", num_decode_groups=2,
                     name="two") as fleet:
        d0, d1 = fleet_group(fleet, "two-d0"), fleet_group(fleet, "two-d1")
        threads, results, progress = _open_streams(fleet, prompts, params)
        _wait_until(lambda: sum(p >= 2 for p in progress) >= 4, 60, "streams decoding")
        ray.kill(d0.rank_actors()[0], no_restart=True)
        _join(threads, 200)
        # Every request completed: those on d0 were re-prefilled and continued on d1.
        assert [results[i][1].finish_reason for i in range(16)] == ["length"] * 16
        assert [results[i][0] for i in range(16)] == expected
        health = fleet.health()
        assert health["groups"]["two-d0"]["state"] == "dead" and health["status"] == "degraded"

        # Now the last decode group dies: open requests end with a clear error, none hangs.
        threads, results, progress = _open_streams(fleet, prompts[:8], params)
        _wait_until(lambda: sum(p >= 2 for p in progress) >= 2, 60, "streams decoding on d1")
        ray.kill(d1.rank_actors()[0], no_restart=True)
        _join(threads, 120)
        reasons = [results[i][1].finish_reason for i in range(8)]
        failed = [results[i][1] for i in range(8) if reasons[i] == "error"]
        assert len(failed) >= 1 and reasons.count("length") + len(failed) == 8
        for ev in failed:
            assert ev.error.startswith("no decode group is available: two-d0 is dead (a rank died")
            assert ev.failure is FailureKind.GROUP_FAILED
        _wait_until(lambda: fleet.health()["status"] == "dead", 30, "fleet status dead")
        late = fleet.generate([prompts[0]], params, timeout_s=60)[0]
        assert late.finish_reason == "error" and "no decode group is available" in late.error
        assert late.failure is FailureKind.GROUP_FAILED


@pytest.mark.timeout(300)
def test_restart_killed_while_capturing_is_retried_until_a_generation_is_ready(ray_local, path, reference):
    """A rank killed while its group's new generation captures fails that start; the group starts
    another after a backoff, and the requests it held complete token for token."""
    prompts = _prompts(4, seed=12)
    expected = [o.token_ids for o in reference(prompts)]
    killed: list[str] = []

    def kill_the_first_restart_while_capturing(group_id, state, waiting):
        if state.value != "capturing" or killed:
            return
        names = [n for n in ray.util.list_named_actors() if n.startswith(f"graphfleet-{group_id}-")]
        newest = max(names, key=lambda n: int(n.split("-")[-2]))
        if not newest.startswith(f"graphfleet-{group_id}-0-"):
            killed.append(newest)
            ray.kill(ray.get_actor(newest), no_restart=True)  # before the capture call reaches it

    with Fleet.start(_config(path), name="cap", on_group_state=kill_the_first_restart_while_capturing) as fleet:
        group = fleet_group(fleet, "cap-c0")
        threads, results, progress = _open_streams(fleet, prompts, GREEDY)
        _wait_until(lambda: sum(p >= 2 for p in progress) >= 2, 60, "streams decoding")
        ray.kill(group.rank_actors()[0], no_restart=True)
        _join(threads, 200)
        assert killed == ["graphfleet-cap-c0-1-rank0"]
        assert [results[i][0] for i in range(4)] == expected
        assert [results[i][1].finish_reason for i in range(4)] == ["length"] * 4
        assert group.restarts == 2 and group.health()["generation"] == 2
        _wait_until(lambda: fleet.health()["status"] == "ready" and _pages_back(fleet), 60, "fleet ready again")
