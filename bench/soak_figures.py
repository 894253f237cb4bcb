"""The fault soak's figures: counts, latencies inside and outside fault windows, and its violations.

Used by :mod:`bench.soak` (the module docstring there says how a greedy answer is judged).
"""

from __future__ import annotations

from dataclasses import asdict

from bench.soak_faults import FaultRecord
from bench.soak_load import Outcome

# ----- what it shows -----

def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _in_windows(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


#: A request sent this long after a fault window closed meets no backlog of it: "steady" latencies
#: are those (on the GPU soak the requests sent 30-60 s after a window had the TTFT p99 of those sent
#: a minute or more after, 0.41 against 0.42 s, while those sent within 10 s had 10.4 s).
RECOVERY_S = 30.0


def _steady(t: float, windows: list[tuple[float, float]]) -> bool:
    """Sent outside every window and at least :data:`RECOVERY_S` after the end of each one before it."""
    return all(t < a or t >= b + RECOVERY_S for a, b in windows)


#: How a greedy answer is judged (see the module docstring).
TEXT_CHECKS = ("exact", "complete")


def summarize(outcomes: list[Outcome], references: list[str], faults: list[FaultRecord], extra: dict,
              max_tokens: int, text_check: str = "exact") -> dict:
    """The soak's figures (counts, latencies inside and outside fault windows) and its violations."""
    if text_check not in TEXT_CHECKS:
        raise ValueError(f"text_check must be one of {TEXT_CHECKS}, not {text_check!r}")
    windows = [(f.at, (f.ready_again or f.at) + 5.0) for f in faults]

    def inside(o: Outcome) -> bool:
        return _in_windows(o.sent, windows) or _in_windows(o.ended, windows)

    greedy = [o for o in outcomes if o.kind == "greedy"]
    complete = [o for o in greedy if o.status == 200 and o.error is None and o.finish_reason == "length"
                and o.tokens == max_tokens]
    equal = [o for o in complete if o.text == references[o.prompt]]
    gave_up = [o for o in greedy if o.error and "given up" in o.error]
    answered = equal if text_check == "exact" else complete
    # Membership by identity: a dataclass ``in`` a list compares every field, quadratic over a GPU soak's
    # 40,000 outcomes (hours; it cost a finished 10-minute soak its JSON).
    settled = {id(o) for o in answered} | {id(o) for o in gave_up}
    lost = [o for o in greedy if id(o) not in settled and not o.hung]
    equal_ids = {id(o) for o in equal}
    diverged = [o for o in complete if id(o) not in equal_ids]
    bad = [o for o in outcomes if o.kind == "bad"]
    bad_wrong = [o for o in bad if not (400 <= o.status < 500 and o.error and ": " in o.error) or o.hung]
    ttft = {"faults": [], "clean": [], "steady": []}
    tpot = {"faults": [], "clean": [], "steady": []}
    for o in answered:
        if not o.stream or not o.token_times:
            continue
        where = ["faults"] if inside(o) else ["clean", "steady"] if _steady(o.sent, windows) else ["clean"]
        for k in where:
            ttft[k].append(o.token_times[0] - o.sent)
            if len(o.token_times) > 1:
                tpot[k].append((o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1))
    figures = {
        "text_check": text_check,
        "requests": len(outcomes), "greedy": len(greedy), "greedy_complete": len(complete),
        "greedy_equal": len(equal), "greedy_gave_up": len(gave_up), "lost": len(lost),
        "diverged": {"faults": sum(inside(o) for o in diverged), "clean": sum(not inside(o) for o in diverged)},
        "hung": sum(o.hung for o in outcomes),
        "bad": len(bad), "bad_wrong": len(bad_wrong),
        "disconnects": sum(o.kind == "disconnect" for o in outcomes),
        "faults": [asdict(f) for f in faults],
        "fault_errors": [f"{f.kind}/{f.role}: {f.error}" for f in faults if f.error],
        # faults: sent or ended inside a window; clean: the rest; steady: the clean ones sent
        # RECOVERY_S or more after every window before them (no fault's backlog left).
        **{f"{name}_p{round(q * 100)}_s": {k: _pct(v, q) for k, v in values.items()}
           for name, values in (("ttft", ttft), ("tpot", tpot)) for q in (0.5, 0.99)},
        "lost_examples": [asdict(o) | {"want": references[o.prompt]} for o in lost[:3]],
        "diverged_examples": [asdict(o) | {"want": references[o.prompt]} for o in diverged[:2]],
        "bad_wrong_examples": [asdict(o) for o in bad_wrong[:3]],
        **extra,
    }
    return figures


def violations(figures: dict, rss_growth_limit_mb: float) -> list[str]:
    """What the soak must never see, as sentences (empty when it passed)."""
    found = []
    for key in ("hung", "lost", "bad_wrong", "pages_leaked", "replica_restarts"):
        if figures[key]:
            found.append(f"{key}: {figures[key]}")
    found += figures["fault_errors"]
    missed = [f"{f['kind']}/{f['role']}" for f in figures["faults"] if not f["hits"]]
    if missed:
        found.append(f"faults that hit nothing: {missed}")
    capturing = [f for f in figures["faults"] if f["kind"] == "kill_capturing"]
    if any(f["hits"][-1]["phase"] != "capturing" for f in capturing if f["hits"]):
        found.append(f"kill_capturing hit a group outside its capture: {[f['hits'] for f in capturing]}")
    if figures["rss_growth_mb"] > rss_growth_limit_mb:
        found.append(f"replica RSS grew {figures['rss_growth_mb']:.0f} MiB (limit {rss_growth_limit_mb:.0f})")
    return found


def print_summary(figures: dict) -> None:
    keys = ("text_check", "requests", "greedy", "greedy_complete", "greedy_equal", "greedy_gave_up", "lost",
            "diverged", "hung", "bad", "bad_wrong",
            "disconnects", "pages_leaked", "replica_restarts", "rss_start_mb", "rss_growth_mb")
    for k in keys:
        print(f"{k:>18}: {figures[k]}")
    for f in figures["faults"]:
        hits = ", ".join(f"{h['signal']} {h['actor']} ({h['phase']})" for h in f["hits"])
        took = f"ready again after {f['ready_again'] - f['at']:.1f}s" if f["ready_again"] else f"error {f['error']}"
        print(f"  fault {f['kind']}/{f['role']}: {hits}; {took}")
    for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        print(f"{k:>18}: {figures[k]}")
