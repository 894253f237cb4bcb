"""bench/capture.py's report: each row's GiB and its ratios over the no-graph rows, the tables, and
with ``--explain`` where the allocator's bytes went (bench/alloc_trace.py)."""

from __future__ import annotations

from bench.common import print_table


def report(rows: list[dict], served: int) -> None:
    """Add each row's GiB and ratios (over the none rows with the MLP whole: the no-graph
    baselines) to ``rows`` and print the tables."""
    def base_of(decode: str) -> int | None:
        return next((r.get("above_baseline_bytes") for r in rows
                     if r.get("backend") == "none" and r.get("decode") == decode and r["lm_head"] == "compute"
                     and r.get("mlp_chunk") == 0), None)

    baseline = base_of("-")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']}:{r['ceiling']}:{r['warm_up']}:{r['decode']}:{r['lm_head']} failed: {r['error']}")
    for r in rows:
        if "above_baseline_bytes" in r:
            r["peak_GiB"] = r["above_baseline_bytes"] / 2**30
            r["held_GiB"] = r["held_bytes"] / 2**30
            r["pool_GiB"] = r["pool_bytes"] / 2**30
            r["outside_GiB"] = r["outside_bytes"] / 2**30
            r["live_peak_GiB"] = r["live_peak_bytes"] / 2**30
            r["vs_no_graph"] = r["above_baseline_bytes"] / baseline if baseline else None
            r["held_vs_no_graph"] = r["held_bytes"] / baseline if baseline else None
            same = base_of(r["decode"]) if r["decode"] != "-" else None
            eager = base_of("eager") if r["decode"] != "-" else None
            r["vs_same_decode"] = r["above_baseline_bytes"] / same if same else None
            r["vs_all_eager"] = r["above_baseline_bytes"] / eager if eager else None
            if r.get("served_peak_bytes") is not None:
                served_base = next((x.get("served_peak_bytes") for x in rows if x.get("backend") == "none"
                                    and x.get("decode") == r["decode"] and x.get("mlp_chunk") == 0), None)
                r["served_peak_GiB"] = r["served_peak_bytes"] / 2**30
                r["served_held_GiB"] = r["served_held_bytes"] / 2**30
                r["served_vs_no_graph"] = r["served_peak_bytes"] / served_base if served_base else None
    print("peak and held: GiB the allocator reserves above the model (peak from before capture to after a "
          f"chunk-size prefill; held after it); vs_no_graph over the eager peak ({(baseline or 0) / 2**30:.3f} GiB); "
          "vs_same_decode over the row without prefill graphs and the same decode; vs_all_eager over no graphs "
          "at all with an eager decode step")
    print("live_peak: the most the allocator had handed out at once over the same window (reserved above it is "
          "the caching allocator's slack: what a tighter layout could give back)")
    print_table(rows, ["backend", "ceiling", "warm_up", "decode", "lm_head", "mlp_chunk", "mode", "shapes",
                       "failed", "build_s", "compile_s", "capture_s", "peak_GiB", "live_peak_GiB", "held_GiB",
                       "pool_GiB", "outside_GiB", "vs_no_graph", "held_vs_no_graph", "vs_same_decode", "vs_all_eager",
                       "chunk_ms"])
    if served:
        print(f"after {served} more prefills of a serving history: served_vs_no_graph is the served peak "
              "over the no-prefill-graph row's of the same decode mode")
        print_table(rows, ["backend", "ceiling", "warm_up", "decode", "served_modes", "served_peak_GiB",
                           "served_held_GiB", "served_vs_no_graph"])
    for r in rows:
        if r.get("allocator"):
            from bench.alloc_trace import summary_lines

            for line in summary_lines(r["allocator"]):
                print(f"  {r['backend']}:{r['ceiling']}:{r['warm_up']}:{r['decode']} {line}")
            growth = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in r.get("pool_growth_by_shape", {}).items())
            print(f"  {r['backend']}:{r['ceiling']}:{r['warm_up']}:{r['decode']} pool growth by shape (MiB): {growth}")
        for where, key in (("outside the pool", "outside_sites"), ("live in the pool", "pool_live_sites")):
            for site in r.get(key) or []:
                print(f"  {r['backend']}:{r['ceiling']}:{r['warm_up']}:{r['decode']} {where} "
                      f"{site['MiB']:8.1f} MiB  {site['site']}")
