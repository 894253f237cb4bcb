"""bench/alloc_trace.py: an allocator history read back into slack, growths and a planned layout (CPU)."""

from __future__ import annotations

import random

from bench.alloc_trace import analyze, live_peak_of, plan_offsets, planned_bytes, summary_lines

MiB = 2**20
POOL = (1, 7)


def _seg(address, size, pool=POOL, stream=0, blocks=None):
    return {"address": address, "total_size": size, "stream": stream, "segment_pool_id": pool,
            "blocks": blocks if blocks is not None else [{"size": size, "state": "inactive"}]}


def _fragmenting_history(base=1 << 32):
    """Three blocks carved from one 100 MiB segment, the outer two freed (80 MiB free in two 40 MiB
    gaps), then a 60 MiB request that fits neither: a second segment."""
    s1, s2 = base, base + 1024 * MiB
    frames = [{"filename": "/x/worker/model/llama.py", "line": 120, "name": "forward"}]
    trace = [
        {"action": "segment_alloc", "addr": s1, "size": 100 * MiB, "stream": 0},
        {"action": "alloc", "addr": s1, "size": 40 * MiB, "stream": 0},
        {"action": "alloc", "addr": s1 + 40 * MiB, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": s1 + 60 * MiB, "size": 40 * MiB, "stream": 0},
        {"action": "free_requested", "addr": s1, "size": 40 * MiB, "stream": 0},
        {"action": "free_completed", "addr": s1, "size": 40 * MiB, "stream": 0},
        {"action": "free_requested", "addr": s1 + 60 * MiB, "size": 40 * MiB, "stream": 0},
        {"action": "free_completed", "addr": s1 + 60 * MiB, "size": 40 * MiB, "stream": 0},
        {"action": "segment_alloc", "addr": s2, "size": 60 * MiB, "stream": 0},
        {"action": "alloc", "addr": s2, "size": 60 * MiB, "stream": 0, "frames": frames},
    ]
    end = [_seg(s1, 100 * MiB), _seg(s2, 60 * MiB)]
    return trace, end


def test_a_fragmented_request_is_reported_with_what_was_free():
    trace, end = _fragmenting_history()
    out = analyze([], trace, end, site=lambda frames: frames[0]["name"] if frames else "?")
    r = out["pool 1,7"]
    assert r["reserved_peak_bytes"] == 160 * MiB
    assert r["live_peak_bytes"] == 100 * MiB  # the three blocks at once
    assert r["slack_at_reserved_peak_bytes"] == 80 * MiB  # 20 + 60 live when 160 was reserved
    assert r["new_segments"] == 2 and r["new_segment_bytes"] == 160 * MiB
    growth = r["growths"][0]  # largest first: the 100 MiB segment (nothing free then)
    assert growth == {"segment_bytes": 100 * MiB, "free_bytes": 0, "largest_free_bytes": 0,
                      "request_bytes": 40 * MiB, "site": "?"}
    fragmented = r["growths"][1]
    assert fragmented == {"segment_bytes": 60 * MiB, "free_bytes": 80 * MiB, "largest_free_bytes": 40 * MiB,
                          "request_bytes": 60 * MiB, "site": "forward"}
    # a plan of the same lifetimes: 40 + 20 + 40 at once, then the 60 in the space the two 40s left
    assert r["large_live_peak_bytes"] == 100 * MiB
    assert r["planned_bytes"] == 100 * MiB


def test_pools_streams_and_the_small_pool_are_kept_apart():
    """Free space in another pool, on another stream or in a 2 MiB small-pool segment is not free
    for a large request; segments already there at the start count toward the pool's reserve."""
    base = 1 << 33
    other_pool, other_stream, small, ours = base, base + 512 * MiB, base + 1024 * MiB, base + 2048 * MiB
    start = [_seg(other_pool, 50 * MiB, pool=(0, 0)), _seg(other_stream, 50 * MiB, stream=9),
             _seg(small, 2 * MiB),
             _seg(ours, 30 * MiB, blocks=[{"size": 10 * MiB, "state": "active_allocated"},
                                          {"size": 20 * MiB, "state": "inactive"}])]
    new = base + 4096 * MiB
    trace = [{"action": "segment_alloc", "addr": new, "size": 24 * MiB, "stream": 0},
             {"action": "alloc", "addr": new, "size": 24 * MiB, "stream": 0}]
    out = analyze(start, trace, [*start, _seg(new, 24 * MiB)])
    r = out["pool 1,7"]
    assert r["growths"][0]["free_bytes"] == 20 * MiB  # only our pool's, our stream's, large segments'
    assert r["growths"][0]["largest_free_bytes"] == 20 * MiB
    assert r["reserved_peak_bytes"] == (50 + 2 + 30 + 24) * MiB  # the stream-9 segment is in this pool too
    assert r["live_peak_bytes"] == (10 + 24) * MiB
    assert out["default"]["reserved_peak_bytes"] == 50 * MiB and out["default"]["growths"] == []


def test_a_freed_segment_leaves_the_reserve_and_unknown_segments_are_their_own_pool():
    base = 1 << 34
    trace = [{"action": "segment_alloc", "addr": base, "size": 40 * MiB, "stream": 3},
             {"action": "alloc", "addr": base, "size": 40 * MiB, "stream": 3},
             {"action": "free_completed", "addr": base, "size": 40 * MiB, "stream": 3},
             {"action": "segment_free", "addr": base, "size": 40 * MiB, "stream": 3},
             {"action": "alloc", "addr": base + 8, "size": 8, "stream": 3}]  # in no segment: skipped
    out = analyze([], trace, [])
    r = out["pool ?,3"]
    assert r["reserved_peak_bytes"] == 40 * MiB and r["live_peak_bytes"] == 40 * MiB
    assert r["planned_bytes"] == 40 * MiB


def test_the_plan_is_never_below_the_live_peak_and_packs_disjoint_lifetimes():
    assert planned_bytes([]) == 0 and live_peak_of([]) == 0
    # disjoint in time: one offset for all
    assert planned_bytes([[0, 1, 5], [1, 2, 7], [2, 3, 3]]) == 7
    rng = random.Random(0)
    for _ in range(50):
        spans = []
        for _ in range(rng.randint(1, 40)):  # times across several of the plan's 256-event buckets
            s = rng.randint(0, 1000)
            spans.append([s, s + rng.randint(1, 400), rng.randint(1, 64) * MiB])
        peak, plan = live_peak_of(spans), planned_bytes(spans)
        assert peak <= plan <= sum(size for _, _, size in spans)
        offsets = plan_offsets(spans)
        for i, (s1, e1, z1) in enumerate(spans):  # lifetimes that meet in time never meet in bytes
            for j, (s2, e2, z2) in enumerate(spans[:i]):
                if s1 < e2 and s2 < e1:
                    assert offsets[i] + z1 <= offsets[j] or offsets[j] + z2 <= offsets[i], (spans[i], spans[j])


def test_the_summary_names_the_fragmented_growth():
    trace, end = _fragmenting_history()
    lines = summary_lines(analyze([], trace, end, site=lambda frames: "llama.py:120"))
    assert lines[0].startswith("pool 1,7: reserved peak +160.0 MiB, live peak +100.0, slack at the reserved peak 80.0")
    assert "planned 100.0" in lines[0]
    assert lines[2].strip() == "+60.0 MiB for 60.0 at llama.py:120: 80.0 free, largest 40.0"


def test_a_ladder_sized_history_is_planned_clear_of_its_long_lifetimes():
    """Thousands of short lifetimes (a capture ladder's, spread over many time buckets) and a few that
    last to the end: the short ones never take the long ones' bytes."""
    rng = random.Random(1)
    spans = [[t * 10, t * 10 + rng.randint(2, 40), rng.randint(2, 200) * MiB] for t in range(10_000)]
    spans += [[5 * t, 100_010, 4 * MiB] for t in range(40)]  # graph outputs, kept to the end
    offsets = plan_offsets(spans)
    assert planned_bytes(spans) >= live_peak_of(spans)
    kept = [(offsets[i], offsets[i] + spans[i][2]) for i in range(10_000, len(spans))]
    for i in range(0, 10_000, 7):
        lo, hi = offsets[i], offsets[i] + spans[i][2]
        clash = [(a, b) for (a, b), j in zip(kept, range(10_000, len(spans)))
                 if spans[j][0] < spans[i][1] and a < hi and lo < b]
        assert not clash, (spans[i], clash)
