# ruff: noqa: F811 - pytest fixtures imported from test_fleet are redefined as test parameters
"""KV transports other than the object store, through real fleets on a local Ray (CPU).

``nccl`` runs its point-to-point protocol over gloo between CPU ranks; ``cuda_ipc`` must refuse
CPU ranks at start. The GPU paths are in ``test_fleet_gpu.py`` and ``bench/kv_handoff.py``.
"""

from __future__ import annotations

import pytest
import ray

from cluster.kv_transport import KVTransportUnavailable
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
from worker.sampling.params import SamplingParams

#: Logical CPUs of the module's local Ray (the ``ray_local`` fixture in conftest.py).
RAY_CPUS = 16


@pytest.mark.timeout(180)
def test_cuda_ipc_on_cpu_ranks_fails_at_start_and_leaves_nothing(ray_local, path):
    with pytest.raises(KVTransportUnavailable, match="kv_transport=cuda_ipc moves device memory, but the ranks "
                                                     "run on the CPU; use kv_transport=object_store"):
        Fleet.start(_config(path, "cluster.kv_transport=cuda_ipc"), mode="disaggregated", name="ipc")
    _wait_until(lambda: not [n for n in ray.util.list_named_actors() if n.startswith("graphfleet-ipc-")], 60,
                "the fleet's rank actors to be gone")


@pytest.mark.timeout(240)
def test_nccl_transport_over_gloo_matches_engine_and_survives_a_decode_restart(ray_local, path, reference):
    """kv_transport=nccl between CPU ranks: the same point-to-point protocol over gloo. Killing the
    decode rank mid-traffic: every request still completes, and hand-offs to the restarted group
    go over a new pair."""
    prompts = _prompts(6, seed=5)
    with Fleet.start(_config(path, "cluster.kv_transport=nccl"), mode="disaggregated", name="p2p") as fleet:
        outs = fleet.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference(prompts)]
        assert all(o.error is None for o in outs)
        _wait_until(lambda: _pages_back(fleet), 30, "KV pages back on every group")

        more = _prompts(8, seed=6)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        expected = [o.token_ids for o in reference(more, params)]
        group = fleet_group(fleet, "p2p-d0")
        threads, results, progress = _open_streams(fleet, more, params)
        _wait_until(lambda: sum(p >= 2 for p in progress) >= 2, 60, "streams decoding")
        ray.kill(group.rank_actors()[0], no_restart=True)
        _join(threads, 200)
        assert [results[i][0] for i in range(8)] == expected
        assert all(last.finish_reason == "length" for _, last in results.values())
        again = fleet.generate([more[0]], params, timeout_s=120)[0]
        assert again.token_ids == expected[0] and again.error is None
        assert group.restarts == 1
        _wait_until(lambda: _pages_back(fleet), 60, "KV pages back on every group")
