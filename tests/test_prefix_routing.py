"""Prefix-aware routing (fleet/router.py, fleet/prefix_affinity.py): the router's model of what each
group caches, and the policy that sends a request to the group most likely to hold its prefix
unless that group is too far behind the least loaded."""

from __future__ import annotations

import time

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


def test_a_placement_adds_only_the_tokens_its_group_computes():
    router = Router(page_size=16, max_waiting_requests=8)
    loads = _loads(0, 0)
    first = _request("a0", SYSTEM_A, 0)  # 67 tokens, 8 to generate
    assert router.prefill_work(loads[0], first) == (0, 67 + 8)  # nothing cached anywhere yet
    router.assign(loads[0], first, first.num_tokens, 67 + 8)
    again = _request("a1", SYSTEM_A, 1)
    assert router.prefill_work(loads[0], again) == (64, 3 + 8)  # four pages hit: three tokens to compute
    assert router.prefill_work(loads[1], again) == (0, 67 + 8)
    whole = FleetRequest("w", SYSTEM_A, GREEDY, 0, None)  # all of it cached: its last token is still computed
    assert router.prefill_work(loads[0], whole) == (64, 1 + 8)
    prefill = GroupLoad("c0", "prefill", True, 1000, 0, 64, 0, 4096, 1000)  # same table, no decode here
    assert router.prefill_work(prefill, again) == (64, 3)
    scored = FleetRequest("s", again.prompt_ids, SamplingParams(max_tokens=8, prompt_logprobs=1), 0, None)
    assert router.prefill_work(loads[0], scored) == (0, 67 + 8)  # it computes its whole prompt
    blind = Router(page_size=16, max_waiting_requests=8, policy="least_loaded")
    assert blind.prefill_work(loads[0], again) == (0, 67 + 8)


def test_a_burst_on_a_cached_prefix_stays_until_the_uncached_work_exceeds_the_bound():
    """64 requests, each a 1,024-token system prompt and 64 tokens of its own, arrive at once on two
    colocated groups. The first goes to an idle group and computes everything; the others add only
    their own 64 tokens (plus the 64 they generate) there, so they stay until that group's work to
    compute leads the other's by more than 8192 tokens: 57 of them. Counting whole prompts (1,152 tokens
    each) the bound would trip at the 8th."""
    router = Router(page_size=16, max_waiting_requests=64, imbalance_tokens=8192)
    loads = [GroupLoad(f"c{i}", "colocated", True, 100_000, 0, 256, 0, 4096, 100_000) for i in range(2)]
    system = list(range(1000, 2024))
    params = SamplingParams(max_tokens=64, temperature=0)
    placed = []
    for i in range(64):
        fr = FleetRequest(f"r{i}", system + list(range(3000 + 64 * i, 3064 + 64 * i)), params, 0, None)
        load = router.pick_prefill(loads, fr)
        if loads[1].running == 0:  # until the other group holds the prefix too: the bound alone decides
            lead = loads[0].outstanding_tokens - loads[1].outstanding_tokens
            assert load.group_id == ("c0" if lead <= 8192 else "c1"), i
        cached, tokens = router.prefill_work(load, fr)
        router.assign(load, fr, fr.num_tokens, tokens)
        placed.append((load.group_id, cached, tokens))
    assert [g for g, _, _ in placed[:57]] == ["c0"] * 57 and placed[57][0] == "c1"
    assert placed[0][1:] == (0, 1088 + 64) and set(placed[1:57]) == {("c0", 1024, 64 + 64)}
    assert placed[57][1:] == (0, 1088 + 64)  # the first on c1 computes the prefix there
    assert {p for p in placed[58:]} <= {("c0", 1024, 128), ("c1", 1024, 128)}  # both groups hold it now
    assert sum(t for g, _, t in placed if g == "c0") == loads[0].outstanding_tokens


def test_a_waiting_request_counts_in_its_engine_as_the_router_counted_it(checkpoint_dir):
    """The symmetry the load depends on: the work the router adds for a placement is what the group's
    engine then reports for that request while it waits (the ``Admit`` carries the expected prefix); once
    admitted it counts what it really computes, and the load is zero when all are done."""
    from cluster.engine_host import EngineHost
    from cluster.step_channel import LeaderExecutor
    from worker.worker import Worker

    path = checkpoint_dir("tiny-llama")
    config = load_config(None, [f"model.path={path}", "model.device=cpu", "graphs.debug=true", "cache.page_size=16"])
    worker = Worker.local(config)
    host = EngineHost(config, LeaderExecutor(worker, None), "colocated", worker.max_len, lambda *a: None,
                      lambda *a: None, lambda *a: None)  # its loop never runs: this test steps its engine
    engine, router = host.engine, Router(page_size=16, max_waiting_requests=16)
    load = GroupLoad("g", "colocated", True, 1000, 0, 64, 0, worker.max_len, 1000)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    warm = FleetRequest("warm", SYSTEM_A + [9], greedy, 0, None)
    router.assign(load, warm, warm.num_tokens, router.prefill_work(load, warm)[1])
    engine.generate([warm.prompt_ids], greedy)
    assert host._load().outstanding_tokens == 0
    burst = [FleetRequest(f"b{i}", SYSTEM_A + list(range(700, 700 + i + 1)), greedy, 0, None) for i in range(6)]
    added = 0
    for fr in burst:
        cached, tokens = router.prefill_work(load, fr)
        assert cached == 64
        engine.admit(fr.prompt_ids, fr.params, seed=0, request_id=fr.request_id, expected_cached_tokens=cached)
        added += tokens
    assert host._load().outstanding_tokens == added  # what the fleet stops counting when the batch is applied
    engine.step()  # all six admitted on the cached prefix: each computed its own tokens, none is left
    assert host._load().outstanding_tokens == added - sum(fr.num_tokens - 64 for fr in burst)
    assert [engine.requests[fr.request_id].cached_tokens for fr in burst] == [64] * 6
    while engine.has_unfinished():
        engine.step()
    assert host._load().outstanding_tokens == 0
    host.stop()


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


def test_a_burst_on_a_cached_prefix_stays_on_its_group_and_the_load_returns_to_zero(ray_local, checkpoint_dir):
    """Two colocated groups, a 60-token imbalance bound. After one request of a system prompt, eight
    more arrive at once: each leaves its group 3 prompt tokens and 4 to generate, 56 in all, so all
    stay on the group holding the prefix and hit it (counting their 71-token prompts and outputs, the
    second would already have gone to the other group). Once all are done both groups' outstanding
    tokens are back to zero."""
    from fleet.fleet import Fleet
    from worker.engine import Engine

    path = checkpoint_dir("tiny-llama")
    overrides = [f"model.path={path}", "model.device=cpu", "graphs.debug=true", "cache.num_pages=64",
                 "scheduler.chunked_prefill_size=256", "graphs.prefill.max_tokens=256",
                 "cluster.routing_imbalance_tokens=60", "cluster.start_timeout_s=120"]
    prompts = [SYSTEM_A + [700 + i, 701 + i, 702 + i] for i in range(9)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = Engine(load_config(None, overrides)).generate(prompts, params)
    with Fleet.start(load_config(None, overrides), name="burst", num_colocated_groups=2) as fleet:
        got = fleet.generate(prompts[:1], params, timeout_s=120) + fleet.generate(prompts[1:], params, timeout_s=120)
        deadline, health = time.monotonic() + 30, fleet.health()
        while any(g["outstanding_tokens"] or g["requests"] for g in health["groups"].values()):
            assert time.monotonic() < deadline, health["groups"]
            time.sleep(0.05)
            health = fleet.health()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.cached_tokens for o in got] == [0] + [64] * 8
    assert {g: v["prefix_keys"] for g, v in health["groups"].items()} == {"burst-c0": 4, "burst-c1": 0}
    # The first of the burst found both groups idle (c0 by id); the other seven followed the prefix to the busier one.
    assert health["routing"] == {"policy": "prefix_aware", "prefix_routed": 7}
