"""The profile-guided ladder planner: exactness against brute force, budget, ceiling rule, profiles."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs.backends import DebugBackend
from graphs.buckets import default_decode_ladder
from graphs.planner import (
    DecodeProblem,
    MemoryModel,
    PiecewiseLinear,
    PrefillProblem,
    StepCosts,
    decode_bucket,
    expected_padded_rows,
    expected_padded_tokens,
    joint_bytes,
    padding_share,
    plan_decode_ladder,
    plan_ladders,
    plan_prefill_ladder,
    prefill_bucket,
)
from graphs.prefill import LivePrefillBatch, PrefillGraphRunner, default_prefill_ladder
from graphs.profile import BatchProfile, ProfileError

MiB = 2**20


# ----- brute-force references -----

def decode_cost(hist, ladder, costs):
    """The objective for a decode ladder: sum of hist[n] * (replay(bucket) or eager(n))."""
    return float(sum(w * (costs.eager(n) if (b := decode_bucket(n, ladder)) is None else costs.replay(b))
                     for n, w in hist.items()))


def prefill_cost(hist, ladder, costs, slots, max_padding_ratio):
    """The objective for a prefill ladder under the runner's slot and padding-waste rules."""
    return float(sum(w * (costs.eager(t) if (b := prefill_bucket(t, r, ladder, slots, max_padding_ratio)) is None
                          else costs.replay(b)) for (t, r), w in hist.items()))


def merge_profiles(a, b):
    """A new profile with the counts of ``a`` and ``b`` added (e.g. across workers)."""
    merged = BatchProfile(a.decode, a.prefill)
    for n, c in b.decode.items():
        merged.record_decode(n, c)
    for (t, r), c in b.prefill.items():
        merged.record_prefill(t, r, c)
    return merged


def memory_from_ladder_capture(resident, small):
    """A :class:`MemoryModel` from one ladder captured largest first into a fresh pool
    (``{size: CapturedShape.resident_bytes}``: the largest's growth is its bytes alone, the median
    growth of the others the per-graph overhead) and ``small = (size, bytes)`` of a small shape
    captured alone."""
    largest = max(resident)
    rest = sorted(v for k, v in resident.items() if k != largest)
    overhead = rest[len(rest) // 2] if rest else 0
    return MemoryModel(small[0], small[1], largest, resident[largest], max(0, overhead))


def _subsets(items):
    for r in range(len(items) + 1):
        yield from (list(c) for c in itertools.combinations(items, r))


def brute_force_decode(hist, candidates, costs, memory, budget, max_batch_size):
    """Least objective over every subset of the candidates that fits the budget."""
    cands = sorted({c for c in candidates if c <= max_batch_size})
    return min(decode_cost(hist, lad, costs) for lad in _subsets(cands) if memory.ladder_bytes(lad) <= budget)


def _prefill_ladders(candidates, memory, budget, ceiling):
    cands = sorted({c for c in candidates if c < ceiling})
    if memory.ladder_bytes([ceiling]) > budget:
        return [[]]
    return [lad + [ceiling] for lad in _subsets(cands) if memory.ladder_bytes(lad + [ceiling]) <= budget]


def brute_force_prefill(hist, candidates, costs, memory, budget, ceiling, slots, ratio):
    """Least objective over every ladder that keeps the ceiling (when it fits) and fits the budget."""
    return min(prefill_cost(hist, lad, costs, slots, ratio) for lad in _prefill_ladders(candidates, memory, budget,
                                                                                          ceiling))


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def linear_costs(eager_fixed=10e-3, replay_fixed=3e-3, per_item=5e-5):
    return StepCosts(lambda n: eager_fixed + per_item * n, lambda b: replay_fixed + per_item * b)


# ----- hand-picked and seeded random cases -----

def test_decode_hand_picked_equals_brute_force_and_tight_buckets():
    hist = {1: 50, 3: 200, 5: 10, 12: 80, 30: 5}
    cands = [1, 2, 4, 8, 16, 24, 32]
    mem = MemoryModel(1, 10 * MiB, 32, 40 * MiB, 2 * MiB)
    for budget in (0, 10 * MiB, 30 * MiB, 40 * MiB, 44 * MiB, 10**12):
        plan = plan_decode_ladder(hist, cands, linear_costs(), mem, budget, 32)
        assert plan.resident_bytes == mem.ladder_bytes(plan.ladder) <= budget
        assert close(plan.expected_cost_s, brute_force_decode(hist, cands, linear_costs(), mem, budget, 32))
        assert close(plan.expected_cost_s, decode_cost(hist, plan.ladder, linear_costs()))
        assert sorted(plan.ladder + plan.dropped) == cands
    assert plan_decode_ladder(hist, cands, linear_costs(), mem, 0, 32).ladder == []
    assert plan_decode_ladder(hist, cands, linear_costs(), mem, 10**12, 32).ladder == [1, 4, 8, 16, 32]


def test_prefill_hand_picked_rules():
    costs = linear_costs(per_item=1e-6)
    mem = MemoryModel(64, 50 * MiB, 1024, 400 * MiB, 4 * MiB)
    hist = {(100, 1): 40, (100, 9): 500, (30, 1): 20, (700, 2): 10, (1024, 4): 3, (2000, 1): 1}
    plan = plan_prefill_ladder(hist, [64, 128, 256, 512, 2048], costs, mem, 10**12, ceiling=1024, slots=4,
                               max_padding_ratio=2.0)
    # 100 tokens: 128; 30 tokens: a 64 bucket is padding waste (> 2x), so 64 buys nothing; 700: 1024
    assert plan.ladder == [128, 1024]
    assert any("ceiling 1024 added" in n for n in plan.notes)
    assert any("above the ceiling 1024 dropped: [2048]" in n for n in plan.notes)
    assert any("too_many_requests" in n for n in plan.notes)
    tight = plan_prefill_ladder(hist, [64, 128, 256, 512], costs, mem, 400 * MiB, 1024, 4, 2.0)
    assert tight.ladder == [1024] and tight.resident_bytes == 400 * MiB
    none = plan_prefill_ladder(hist, [64, 128], costs, mem, 400 * MiB - 1, 1024, 4, 2.0)
    assert none.ladder == [] and any("ceiling 1024 alone needs" in n for n in none.notes)
    assert close(none.expected_cost_s, prefill_cost(hist, [], costs, 4, 2.0))


@pytest.mark.parametrize("seed", range(40))
def test_random_cases_equal_brute_force(seed):
    rng = random.Random(seed)
    top = rng.choice([16, 64, 300])
    cands = sorted(rng.sample(range(1, top + 10), rng.randint(1, 10)))
    a, b = rng.uniform(1e-3, 2e-2), rng.uniform(0, 1e-4)
    costs = StepCosts.fit([(1, a), (top, a + b * top), (2 * top, a + 3 * b * top)],
                          [(1, a * 0.3), (top, (a + b * top) * 0.5)])
    mem = MemoryModel(1, rng.randint(0, 50) * MiB, top, rng.randint(50, 500) * MiB, rng.randint(0, 20) * MiB)
    budget = rng.randint(0, mem.ladder_bytes(cands + [top]) + MiB)
    dhist = {rng.randint(1, top + 5): rng.randint(0, 100) for _ in range(rng.randint(0, 30))}
    plan = plan_decode_ladder(dhist, cands, costs, mem, budget, top)
    assert plan.resident_bytes == mem.ladder_bytes(plan.ladder) <= budget
    assert close(plan.expected_cost_s, brute_force_decode(dhist, cands, costs, mem, budget, top))
    slots, ratio = rng.randint(1, 4), rng.choice([1.0, 1.5, 2.0, 4.0])
    phist = {(rng.randint(1, top + 5), rng.randint(1, 6)): rng.randint(0, 100) for _ in range(rng.randint(0, 30))}
    plan = plan_prefill_ladder(phist, cands, costs, mem, budget, top, slots, ratio)
    assert plan.resident_bytes <= budget
    assert (top in plan.ladder) == (mem.shape_bytes(top) <= budget)
    assert close(plan.expected_cost_s, brute_force_prefill(phist, cands, costs, mem, budget, top, slots, ratio))


@pytest.mark.parametrize("seed", range(15))
def test_joint_plan_equals_brute_force(seed):
    rng = random.Random(100 + seed)
    dcands, pcands = sorted(rng.sample(range(1, 33), 4)), sorted(rng.sample(range(16, 512), 4))
    dmem = MemoryModel(1, 5 * MiB, 32, rng.randint(10, 200) * MiB, rng.randint(0, 10) * MiB)
    pmem = MemoryModel(16, 20 * MiB, 512, rng.randint(10, 400) * MiB, rng.randint(0, 10) * MiB)
    dhist = {rng.randint(1, 32): rng.randint(0, 100) for _ in range(10)}
    phist = {(rng.randint(1, 512), rng.randint(1, 3)): rng.randint(0, 100) for _ in range(10)}
    dcosts, pcosts = linear_costs(), linear_costs(20e-3, 5e-3, 1e-5)
    budget = rng.randint(0, 600) * MiB
    joint = plan_ladders(DecodeProblem(dhist, dcands, dcosts, dmem, 32),
                         PrefillProblem(phist, pcands, pcosts, pmem, 512, 2, 2.0), budget)
    best = min(decode_cost(dhist, d, dcosts) + prefill_cost(phist, p, pcosts, 2, 2.0)
               for d in _subsets(dcands) for p in _prefill_ladders(pcands, pmem, budget, 512)
               if joint_bytes(d, dmem, p, pmem) <= budget)
    assert close(joint.expected_cost_s, best)
    assert joint.resident_bytes == joint_bytes(joint.decode.ladder, dmem, joint.prefill.ladder, pmem) <= budget
    assert close(joint.expected_cost_s, joint.decode.expected_cost_s + joint.prefill.expected_cost_s)
    assert (512 in joint.prefill.ladder) == (pmem.shape_bytes(512) <= budget)


def test_joint_bytes_model():
    d, p = MemoryModel(1, 0, 64, 100, 3), MemoryModel(64, 0, 1024, 500, 7)
    assert joint_bytes([], d, [], p) == 0
    assert joint_bytes([8, 64], d, [], p) == 100 + 3
    assert joint_bytes([8, 64], d, [128, 1024], p) == 500 + 7 + 2 * 3
    assert MemoryModel(64, 0, 1024, 500).shape_bytes(1024) == 500  # integer arithmetic, no float ceil drift
    assert joint_bytes([64], d, [64], p) == 100 + 7  # decode owns the largest shape


# ----- property test -----

@st.composite
def problems(draw):
    top = draw(st.integers(2, 80))
    cands = draw(st.lists(st.integers(1, top + 8), min_size=1, max_size=8, unique=True))
    xs = sorted(draw(st.lists(st.integers(1, 2 * top), min_size=1, max_size=4, unique=True)))
    steps = draw(st.lists(st.floats(0, 1e-3), min_size=len(xs), max_size=len(xs)))
    eager_y = list(itertools.accumulate(steps, initial=draw(st.floats(1e-4, 1e-2))))[1:]
    share = draw(st.floats(0.05, 1.0))
    costs = StepCosts.fit(list(zip(xs, eager_y)), [(x, y * share) for x, y in zip(xs, eager_y)])
    mem = MemoryModel(1, draw(st.integers(0, 10**6)), top, draw(st.integers(10**6, 10**8)), draw(st.integers(0, 10**6)))
    budget = draw(st.integers(0, 2 * 10**8))
    dhist = draw(st.dictionaries(st.integers(1, top + 8), st.integers(0, 1000), max_size=12))
    phist = draw(st.dictionaries(st.tuples(st.integers(1, top + 8), st.integers(1, 5)), st.integers(0, 1000),
                                 max_size=12))
    return SimpleNamespace(top=top, cands=cands, costs=costs, mem=mem, budget=budget, dhist=dhist, phist=phist,
                           slots=draw(st.integers(1, 4)), ratio=draw(st.floats(1.0, 4.0)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_property_plans_fit_keep_ceiling_and_are_optimal(p):
    for n in range(1, 2 * p.top):  # the drawn costs are monotone, replay no dearer than eager (to rounding)
        assert p.costs.replay(n) <= p.costs.eager(n) + 1e-15 and p.costs.eager(n) <= p.costs.eager(n + 1) + 1e-15
    d = plan_decode_ladder(p.dhist, p.cands, p.costs, p.mem, p.budget, p.top)
    assert p.mem.ladder_bytes(d.ladder) <= p.budget and all(b <= p.top for b in d.ladder)
    assert close(d.expected_cost_s, brute_force_decode(p.dhist, p.cands, p.costs, p.mem, p.budget, p.top))
    f = plan_prefill_ladder(p.phist, p.cands, p.costs, p.mem, p.budget, p.top, p.slots, p.ratio)
    assert p.mem.ladder_bytes(f.ladder) <= p.budget and all(b <= p.top for b in f.ladder)
    assert (f.ladder[-1:] == [p.top]) == (p.mem.ladder_bytes([p.top]) <= p.budget)
    assert close(f.expected_cost_s,
                 brute_force_prefill(p.phist, p.cands, p.costs, p.mem, p.budget, p.top, p.slots, p.ratio))


# ----- skewed traffic -----

def test_skewed_traffic_gets_tight_buckets_within_four_graphs():
    hist = {n: 2 for n in range(1, 65)}
    hist[3], hist[37] = 5000, 5000
    costs = linear_costs()
    mem = MemoryModel(1, 100 * MiB, 64, 100 * MiB, 30 * MiB)  # flat shape bytes: the count binds
    budget = mem.ladder_bytes([1, 2, 3, 64])
    fine = plan_decode_ladder(hist, range(1, 65), costs, mem, budget, 64)
    assert len(fine.ladder) == 4 and {3, 37} <= set(fine.ladder)
    coarse = plan_decode_ladder(hist, default_decode_ladder(64), costs, mem, budget, 64)
    assert len(coarse.ladder) == 4 and {4, 40} <= set(coarse.ladder)
    default = default_decode_ladder(64)
    naive = [default[i] for i in (0, 4, 7, 10)]  # evenly thinned default ladder, 4 graphs
    assert coarse.expected_cost_s < decode_cost(hist, naive, costs)
    assert fine.expected_cost_s <= coarse.expected_cost_s
    assert expected_padded_rows(hist, fine.ladder) < expected_padded_rows(hist, naive)


# ----- pieces -----

def test_prefill_bucket_is_the_runners_predicate():
    step = SimpleNamespace(hidden_size=2, device=torch.device("cpu"))
    ladder = [64, 128, 256, 512]
    runner = PrefillGraphRunner(step, DebugBackend(torch.device("cpu")), ladder, slots=3, max_padding_ratio=1.5,
                                dtype=torch.float32)
    rng = random.Random(0)
    for _ in range(300):
        t, r = rng.randint(1, 600), rng.randint(1, 5)
        batch = LivePrefillBatch(torch.zeros(t, dtype=torch.int64), torch.zeros(t, dtype=torch.int64), None, r)
        assert runner._choose(batch).size == prefill_bucket(t, r, ladder, 3, 1.5)


def test_padding_measures():
    assert expected_padded_rows({3: 10, 5: 1, 9: 7}, [4, 8]) == 10 * 1 + 1 * 3
    hist = {(100, 1): 2, (30, 1): 1, (100, 5): 4}
    assert expected_padded_tokens(hist, [64, 128]) == 2 * 28 + 34 + 4 * 28
    assert expected_padded_tokens(hist, [64, 128], slots=4, max_padding_ratio=2.0) == 2 * 28


def test_piecewise_linear_fit():
    f = PiecewiseLinear.fit([(10, 1.0), (20, 2.0), (20, 4.0), (40, 5.0)])
    assert f(10) == 1.0 and f(20) == 3.0 and f(15) == 2.0 and f(30) == 4.0
    assert f(60) == 7.0 and f(5) == 0.0 and f(0) == 0.0  # extrapolated, clamped at 0 s
    assert PiecewiseLinear.fit([(8, 0.5)])(1000) == 0.5
    with pytest.raises(ValueError, match="at least one"):
        PiecewiseLinear.fit([])
    with pytest.raises(ValueError, match="seconds >= 0"):
        PiecewiseLinear.fit([(1, -1.0)])


def test_memory_model():
    mem = MemoryModel(8, 100, 264, 356, 10)
    assert mem.shape_bytes(8) == 100 and mem.shape_bytes(136) == 228 and mem.shape_bytes(264) == 356
    assert mem.ladder_bytes([]) == 0 and mem.ladder_bytes([8, 16, 264]) == 356 + 20
    captured = memory_from_ladder_capture({256: 1000, 128: 12, 64: 10, 8: 11}, small=(8, 200))
    assert (captured.large_size, captured.large_bytes, captured.per_graph_overhead_bytes) == (256, 1000, 11)
    with pytest.raises(ValueError, match="small_size <= large_size"):
        MemoryModel(64, 0, 8, 0)


def test_empty_profile_keeps_no_decode_graphs_but_the_ceiling():
    costs, mem = linear_costs(), MemoryModel(1, MiB, 8192, 200 * MiB, MiB)
    assert plan_decode_ladder({}, [1, 2, 4], costs, mem, 10**12, 4).ladder == []
    assert plan_prefill_ladder({}, default_prefill_ladder(8192), costs, mem, 10**12, 8192, 4, 2.0).ladder == [8192]


# ----- profiles -----

def test_profile_records_merges_and_round_trips(tmp_path):
    a = BatchProfile()
    for n in (3, 3, 37):
        a.record_decode(n)
    a.record_prefill(512, 2)
    b = BatchProfile({3: 1}, {(512, 2): 4, (64, 1): 1})
    m = merge_profiles(a, b)
    assert m.decode == {3: 3, 37: 1} and m.prefill == {(512, 2): 5, (64, 1): 1}
    assert a.decode == {3: 2, 37: 1}  # merge leaves its inputs alone
    doc = m.to_json()
    assert doc == {"version": 1, "decode": {"3": 3, "37": 1}, "prefill": {"64,1": 1, "512,2": 5}}
    assert BatchProfile.from_json(json.loads(json.dumps(doc))) == m
    m.save(tmp_path / "p.json")
    assert BatchProfile.load(tmp_path / "p.json") == m
    assert (m.decode_steps, m.prefill_steps) == (4, 6)


@pytest.mark.parametrize("doc, field", [
    ({"version": 2, "decode": {}}, "'version'"),
    ({"decode": {}}, "'version'"),
    ({"version": 1, "decode": {"3": -1}}, "decode['3']"),
    ({"version": 1, "decode": {"3": 1.5}}, "decode['3']"),
    ({"version": 1, "decode": {"x": 1}}, "decode['x']"),
    ({"version": 1, "decode": {"0": 1}}, "decode['0']"),
    ({"version": 1, "prefill": {"64": 1}}, "prefill['64']"),
    ({"version": 1, "prefill": {"64,y": 1}}, "prefill['64,y']"),
    ({"version": 1, "prefill": {"64,1": -3}}, "prefill['64,1']"),
    ({"version": 1, "decode": []}, "'decode'"),
    ({"version": 1, "extra": 1}, "'extra'"),
])
def test_profile_errors_name_the_field(doc, field):
    with pytest.raises(ProfileError, match=re.escape(f"profile field {field}")):
        BatchProfile.from_json(doc)


def test_profile_load_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"version": 1, "decode": {"3": -2}}')
    with pytest.raises(ProfileError, match=r"bad\.json: profile field decode\['3'\]"):
        BatchProfile.load(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        BatchProfile.load(path)
    with pytest.raises(ValueError, match="decode batch size"):
        BatchProfile().record_decode(0)


def test_padding_share_counts_what_the_graphs_replayed_since_a_copy():
    profile = BatchProfile(decode={3: 10, 8: 5}, prefill={(100, 1): 4})
    earlier = profile.copy()
    profile.record_decode(3, 30)
    profile.record_decode(9, 7)  # above the ladder: eager, pads nothing and is not counted as replayed
    profile.record_prefill(300, 2, 2)
    since = profile.since(earlier)
    assert since.decode == {3: 30, 9: 7} and since.prefill == {(300, 2): 2} and earlier.decode == {3: 10, 8: 5}
    share = padding_share(since, [1, 2, 4, 8], [256, 512], slots=4, max_padding_ratio=2.0)
    # decode: 30 batches of 3 padded to 4 -> 30 of 120 rows; prefill: 300 tokens padded to 512 -> 212 of 512
    assert share["decode"] == (pytest.approx(30 / 120), 37)
    assert share["prefill"] == (pytest.approx(212 / 512), 2)
    assert padding_share(since, None, None) == {} and padding_share(BatchProfile(), [1, 2], [256]) == {}


@pytest.mark.parametrize("key,value,message", [("replan_interval_s", 0, "must be > 0 seconds"),
                                               ("replan_padding_share", 1.0, r"must be in \(0, 1\)")])
def test_automatic_replan_settings_are_checked(key, value, message):
    from configkit import ConfigError
    from deploy.config import load_config

    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [f"graphs.{key}={value}"])
    assert key in str(e.value)
