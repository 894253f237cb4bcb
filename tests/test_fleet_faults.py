# ruff: noqa: F811 - pytest fixtures imported from test_fleet are redefined as test parameters
"""A rank killed while its group's new generation starts, and again while it captures: the fleet
keeps serving on its other groups meanwhile, and the group comes back (local Ray, CPU)."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from fleet.fleet import Fleet
from tests.fleet_probes import fleet_group
from tests.test_fleet import (  # noqa: F401 - fixtures are used by name
    _config,
    _join,
    _open_streams,
    _pages_back,
    _prompts,
    _wait_until,
    path,
    reference,
)
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
