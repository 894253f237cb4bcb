"""Prefix-aware routing (fleet/router.py, fleet/prefix_affinity.py): the router's model of what each
group caches, and the policy that sends a request to the group most likely to hold its prefix
unless that group is too far behind the least loaded."""

from __future__ import annotations

import pytest

from configkit import ConfigError
from deploy.config import load_config
from fleet.config import apply_fleet_options, group_layout
from fleet.prefix_affinity import PrefixAffinity
from fleet.request import FleetRequest
from fleet.router import GroupLoad, Router
from worker.prefix_hash import page_keys
from worker.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)
SYSTEM_A = list(range(100, 164))  # 4 pages of 16
SYSTEM_B = list(range(500, 564))


def _request(rid: str, prefix: list[int], tail: int) -> FleetRequest:
    return FleetRequest(rid, prefix + [7000 + tail, 7001 + tail, 7002 + tail], GREEDY, 0, None)


def _loads(*outstanding: int) -> list[GroupLoad]:
    return [GroupLoad(f"c{i}", "colocated", True, 1000, 0, 64, t, 4096, 1000) for i, t in enumerate(outstanding)]


def test_affinity_matches_leading_keys_and_forgets_least_recently_used():
    table = PrefixAffinity()
    a, b = page_keys(SYSTEM_A, 16), page_keys(SYSTEM_B, 16)
    table.record("g", a, capacity=6)
    assert table.match("g", a) == 4 and table.match("g", b) == 0 and table.match("other", a) == 0
    assert table.match("g", a[:2] + b[2:]) == 2  # only the leading run counts
    table.record("g", b[:2], capacity=6)  # 6 keys now: a's four, then b's two
    table.record("g", a[:1], capacity=6)  # a[0] becomes the most recently used
    table.record("g", b[2:], capacity=6)  # two more: the two least recently used (a[1], a[2]) go
    assert table.size("g") == 6
    assert table.match("g", a) == 1 and table.match("g", b) == 4
    table.forget("g")
    assert table.match("g", b) == 0 and table.size("g") == 0


def test_router_follows_the_prefix_within_the_imbalance_bound():
    router = Router(page_size=16, max_waiting_requests=8, imbalance_tokens=100)
    loads = _loads(0, 0)
    first = _request("a0", SYSTEM_A, 0)
    assert router.pick_prefill(loads, first).group_id == "c0"  # no match anywhere: least loaded (ties by id)
    router.assign(loads[0], first, first.num_tokens, 80)
    other = _request("b0", SYSTEM_B, 1)
    assert router.pick_prefill(loads, other).group_id == "c1"  # no match: least loaded
    router.assign(loads[1], other, other.num_tokens, 10)
    again = _request("a1", SYSTEM_A, 2)
    assert router.pick_prefill(loads, again).group_id == "c0"  # matched, 70 tokens behind c1: within 100
    assert router.prefix_routed == 1
    loads[0].outstanding_tokens = 200  # now 190 behind the least loaded: the bound sends it there
    assert router.pick_prefill(loads, again).group_id == "c1"
    router.forget_group("c1")  # c1 restarted: its B prefix is no longer cached there
    assert router.pick_prefill(loads, _request("b1", SYSTEM_B, 3)).group_id == "c1"  # least loaded, no match
    loads[0].outstanding_tokens = loads[1].outstanding_tokens = 0
    # no match, equal loads: the group caching fewer pages (c1 forgot its table) takes the new prefix
    assert router.pick_prefill(loads, _request("b2", SYSTEM_B, 4)).group_id == "c1"


def test_least_loaded_policy_and_a_full_group_ignore_the_prefix():
    router = Router(page_size=16, max_waiting_requests=8, policy="least_loaded")
    loads = _loads(0, 0)
    for i in range(4):  # alternates with the load, whatever the prefix
        req = _request(f"a{i}", SYSTEM_A, i)
        load = router.pick_prefill(loads, req)
        assert load.group_id == f"c{i % 2}"
        router.assign(load, req, req.num_tokens, 50)
    assert router.affinity.size("c0") == 0  # nothing recorded under least_loaded
    aware = Router(page_size=16, max_waiting_requests=8)
    loads = _loads(0, 0)
    req = _request("a", SYSTEM_A, 0)
    aware.assign(loads[0], req, req.num_tokens, 0)
    loads[0].running = loads[0].max_running  # the matching group cannot take another request now
    assert aware.pick_prefill(loads, _request("a2", SYSTEM_A, 1)).group_id == "c1"


def test_routing_keys_and_colocated_groups_in_the_config(tmp_path):
    cfg = load_config(None, ["cluster.num_colocated_groups=3", "cluster.routing=least_loaded"])
    assert cfg.cluster.routing == "least_loaded"
    cfg, fleet = apply_fleet_options(cfg, name="f")
    assert group_layout(cfg.cluster, fleet.name) == [("f-c0", "colocated"), ("f-c1", "colocated"),
                                                      ("f-c2", "colocated")]
    with pytest.raises(ConfigError, match="cluster.routing"):
        load_config(None, ["cluster.routing=random"])
    with pytest.raises(ConfigError, match="cluster.routing_imbalance_tokens: must be >= 0"):
        load_config(None, ["cluster.routing_imbalance_tokens=-1"])
    with pytest.raises(ConfigError, match="cluster.num_colocated_groups: must be >= 1"):
        load_config(None, ["cluster.num_colocated_groups=0"])


# ----- a fleet of two colocated groups on a real local Ray -----

RAY_CPUS = 8


def test_two_colocated_groups_keep_each_prefix_on_one_group(ray_local, checkpoint_dir):
    """Requests of two system prompts, one after another, on two colocated groups: each prompt's
    family stays on the group its first request went to (the tables hold each family's pages
    only), and every output equals the in-process engine's."""
    from fleet.fleet import Fleet
    from worker.engine import Engine

    path = checkpoint_dir("tiny-llama")
    overrides = [f"model.path={path}", "model.device=cpu", "graphs.debug=true", "cache.num_pages=64",
                 "scheduler.max_running_requests=4", "scheduler.chunked_prefill_size=256",
                 "graphs.prefill.max_tokens=256", "graphs.decode.max_batch_size=4", "cluster.start_timeout_s=120"]
    system_a, system_b = list(range(100, 164)), list(range(300, 396))  # 4 and 6 pages of 16
    prompts = [(system_a if i % 2 == 0 else system_b) + [700 + i, 701 + i] for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = Engine(load_config(None, overrides)).generate(prompts, params)
    with Fleet.start(load_config(None, overrides), name="pfx", num_colocated_groups=2) as fleet:
        got = [fleet.generate([p], params, timeout_s=120)[0] for p in prompts]  # one at a time
        health = fleet.health()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert {g: v["prefix_keys"] for g, v in health["groups"].items()} == {"pfx-c0": 4, "pfx-c1": 6}
    assert health["routing"] == {"policy": "prefix_aware", "prefix_routed": 2}  # b's 2nd and 3rd over c0's tie
