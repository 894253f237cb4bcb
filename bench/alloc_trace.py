"""Where the caching allocator's reserved memory goes beyond what was live: an allocation trace read back.

``bench/capture.py --explain`` records the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history``) from before the captures to after the chunk-size
prefill, with a snapshot of the segments at the start and at the end. :func:`analyze` replays that
history and reports, per memory pool:

- ``reserved_start`` and ``live_start``: what the pool held when recording began (the model's
  weights and KV cache in the default pool), so the peaks can be read above it.
- ``reserved_peak`` and ``live_peak``: the most the pool reserved (segments) and the most it had
  handed out at once; ``slack_at_reserved_peak``: the reserved peak less the most that was live
  while the reserve stood there (the allocator's slack at its tightest).
- ``growths``: every new segment the window made (a ``cudaMalloc``), with the request that made it,
  its allocation site, and what the pool had free for that request's stream at that moment, in all
  and as its largest free block: "176 MiB asked with 200 MiB free, the largest block 120 MiB" is
  fragmentation; "with nothing free" is the forward's own peak.
- ``planned``: the bytes one arena would need for the same large allocations at the same lifetimes
  if their offsets were planned (first fit in decreasing size: an upper bound on the best plan, and
  never below ``live_peak`` of those allocations). A captured graph replays a fixed allocation
  sequence, so a graph pool could be laid out this way; an eager forward of every size could not.

Pure Python over the snapshot's dicts (``segments``: ``address``, ``total_size``, ``stream``,
``segment_pool_id``, ``blocks``; trace entries: ``action``, ``addr``, ``size``, ``stream``,
``frames``), so it is tested on the CPU with hand-made histories.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

#: The small pool's segments: requests of at most 1 MiB share 2 MiB segments and never use a large one.
SMALL_SEGMENT = 2 * 2**20
SMALL_REQUEST = 2**20


@dataclass
class Segment:
    """One ``cudaMalloc``'d range and the blocks live in it (address -> size)."""

    address: int
    size: int
    stream: int
    pool: tuple
    live: dict[int, int] = field(default_factory=dict)

    @property
    def small(self) -> bool:
        return self.size == SMALL_SEGMENT

    def free_blocks(self) -> list[int]:
        """Sizes of the free gaps between the live blocks."""
        gaps, cursor = [], self.address
        for addr in sorted(self.live):
            if addr > cursor:
                gaps.append(addr - cursor)
            cursor = max(cursor, addr + self.live[addr])
        if self.address + self.size > cursor:
            gaps.append(self.address + self.size - cursor)
        return gaps


def _pool_of(seg: dict) -> tuple:
    return tuple(seg.get("segment_pool_id") or (0, 0))


def analyze(start_segments: list[dict], trace: list[dict], end_segments: list[dict],
            site: Callable[[list[dict]], str] = lambda frames: "?", top: int = 12) -> dict:
    """Replay ``trace`` from the layout ``start_segments`` (snapshot segments when recording began);
    ``end_segments`` name the pools of segments the window made. Returns ``{pool: report}`` keyed by
    ``"pool a,b"`` (``"default"`` for (0, 0)); see the module docstring for the report's fields.
    ``site`` names an allocation by its frames; ``top``: growths listed, largest first."""
    pools_by_addr = {s["address"]: _pool_of(s) for s in [*start_segments, *end_segments]}
    segments: dict[int, Segment] = {}
    for s in start_segments:
        seg = Segment(s["address"], s["total_size"], s.get("stream", 0), _pool_of(s))
        addr = s["address"]
        for b in s.get("blocks", []):
            if b.get("state") != "inactive":
                seg.live[addr] = b["size"]
            addr += b["size"]
        segments[seg.address] = seg
    reports: dict[tuple, dict] = {}
    # intervals of large allocations for the planned layout: pool -> [[start, end, size]]
    intervals: dict[tuple, list[list[int]]] = {}
    open_interval: dict[int, list[int]] = {}
    pending_growth: dict[int, dict] = {}  # stream -> the growth waiting for its request

    def report(pool: tuple) -> dict:
        return reports.setdefault(pool, {"reserved": 0, "live": 0, "reserved_peak": 0, "live_peak": 0,
                                         "live_at_reserved_peak": 0, "growths": []})

    for seg in segments.values():
        r = report(seg.pool)
        r["reserved"] += seg.size
        r["live"] += sum(seg.live.values())
    for r in reports.values():
        r["reserved_peak"], r["live_peak"], r["live_at_reserved_peak"] = r["reserved"], r["live"], r["live"]
        r["reserved_start"], r["live_start"] = r["reserved"], r["live"]

    starts = sorted(segments)  # segment addresses, for a bisection per event

    def owner(addr: int) -> Segment | None:
        i = bisect.bisect_right(starts, addr) - 1
        seg = segments.get(starts[i]) if i >= 0 else None
        return seg if seg is not None and addr < seg.address + seg.size else None

    for t, e in enumerate(trace):
        action, addr, size = e.get("action"), e.get("addr", 0), e.get("size", 0)
        if action in ("segment_alloc", "segment_map"):
            pool = pools_by_addr.get(addr, ("?", e.get("stream", 0)))
            large = size != SMALL_SEGMENT
            free = [g for s in segments.values() if s.pool == pool and s.stream == e.get("stream", 0)
                    and not s.small and large for g in s.free_blocks()]
            seg = segments.get(addr)
            if seg is not None and action == "segment_map":  # an expandable segment grows in place
                seg.size += size
            else:
                segments[addr] = Segment(addr, size, e.get("stream", 0), pool)
                bisect.insort(starts, addr)
            r = report(pool)
            r["reserved"] += size
            growth = {"segment_bytes": size, "free_bytes": sum(free), "largest_free_bytes": max(free, default=0)}
            r["growths"].append(growth)
            pending_growth[e.get("stream", 0)] = growth
        elif action in ("segment_free", "segment_unmap"):
            seg = segments.pop(addr, None)
            if seg is not None:
                starts.remove(addr)
                report(seg.pool)["reserved"] -= seg.size
        elif action == "alloc":
            seg = owner(addr)
            if seg is None:
                continue
            seg.live[addr] = size
            r = report(seg.pool)
            r["live"] += size
            growth = pending_growth.pop(e.get("stream", 0), None)
            if growth is not None:
                growth["request_bytes"], growth["site"] = size, site(e.get("frames", []))
            if size > SMALL_REQUEST:
                open_interval[addr] = [t, -1, size]
                intervals.setdefault(seg.pool, []).append(open_interval[addr])
        elif action == "free_completed":
            seg = owner(addr)
            if seg is None or addr not in seg.live:
                continue
            report(seg.pool)["live"] -= seg.live.pop(addr)
            if addr in open_interval:
                open_interval.pop(addr)[1] = t
        else:
            continue
        for r in reports.values():
            r["live_peak"] = max(r["live_peak"], r["live"])
            if r["reserved"] > r["reserved_peak"]:
                r["reserved_peak"], r["live_at_reserved_peak"] = r["reserved"], r["live"]
            elif r["reserved"] == r["reserved_peak"]:
                r["live_at_reserved_peak"] = max(r["live_at_reserved_peak"], r["live"])
    out = {}
    for pool, r in reports.items():
        spans = intervals.get(pool, [])
        for s in spans:
            if s[1] < 0:
                s[1] = len(trace)
        growths = sorted(r["growths"], key=lambda g: -g["segment_bytes"])
        out["default" if pool == (0, 0) else f"pool {','.join(map(str, pool))}"] = {
            "reserved_start_bytes": r.get("reserved_start", 0), "live_start_bytes": r.get("live_start", 0),
            "reserved_peak_bytes": r["reserved_peak"], "live_peak_bytes": r["live_peak"],
            "slack_at_reserved_peak_bytes": r["reserved_peak"] - r["live_at_reserved_peak"],
            "new_segments": len(r["growths"]), "new_segment_bytes": sum(g["segment_bytes"] for g in r["growths"]),
            "growths": growths[:top],
            "large_live_peak_bytes": live_peak_of(spans), "planned_bytes": planned_bytes(spans)}
    return out


def live_peak_of(spans: Iterable[list[int]]) -> int:
    """The most bytes of these ``[start, end, size]`` lifetimes live at once."""
    events = sorted([(s, size) for s, _, size in spans] + [(e, -size) for _, e, size in spans],
                    key=lambda ev: (ev[0], ev[1]))  # frees before allocs at one time
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def plan_offsets(spans: list[list[int]]) -> list[int]:
    """An offset for each ``[start, end, size]`` lifetime (``end`` exclusive) such that no two live at
    the same time share a byte: each, largest first, at the lowest offset clear of those placed."""
    offsets = [0] * len(spans)
    # placed lifetimes by time bucket, so a query reads only those near it in time (a capture
    # ladder's history has thousands of short lifetimes)
    width = 256
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(spans)), key=lambda i: -spans[i][2]):
        start, end, size = spans[i]
        near = {j for b in range(start // width, (end - 1) // width + 1) for j in buckets.get(b, ())}
        busy = sorted((offsets[j], offsets[j] + spans[j][2]) for j in near
                      if spans[j][0] < end and start < spans[j][1])
        offset = 0
        for lo, hi in busy:
            if lo >= offset + size:
                break
            offset = max(offset, hi)
        offsets[i] = offset
        for b in range(start // width, (end - 1) // width + 1):
            buckets.setdefault(b, []).append(i)
    return offsets


def planned_bytes(spans: list[list[int]]) -> int:
    """The arena :func:`plan_offsets`'s layout of these lifetimes needs."""
    return max((o + s[2] for o, s in zip(plan_offsets(spans), spans)), default=0)


def summary_lines(pools: dict, growths: int = 4) -> list[str]:
    """:func:`analyze`'s result as text: per pool, MiB above the start and the largest growths."""
    lines = []
    for name, r in pools.items():
        mib = {k: v / 2**20 for k, v in r.items() if k.endswith("_bytes")}
        lines.append(f"{name}: reserved peak +{mib['reserved_peak_bytes'] - mib['reserved_start_bytes']:.1f} MiB, "
                     f"live peak +{mib['live_peak_bytes'] - mib['live_start_bytes']:.1f}, "
                     f"slack at the reserved peak {mib['slack_at_reserved_peak_bytes']:.1f}; "
                     f"{r['new_segments']} new segments ({mib['new_segment_bytes']:.1f} MiB); the window's large "
                     f"allocations: live peak {mib['large_live_peak_bytes']:.1f}, planned {mib['planned_bytes']:.1f}")
        for g in r["growths"][:growths]:
            lines.append(f"    +{g['segment_bytes'] / 2**20:.1f} MiB for {g.get('request_bytes', 0) / 2**20:.1f} "
                         f"at {g.get('site', '?')}: {g['free_bytes'] / 2**20:.1f} free, "
                         f"largest {g['largest_free_bytes'] / 2**20:.1f}")
    return lines
