"""The report a group's engine loop is filling, until the report link's thread takes it.

Invariant (owner: :class:`ReportBuffer`): the report holds one event per request, in the order of
each request's first, so a reader that lags pays per request, not per step. The loop merges as it
adds (a step at a time), never the taking thread: that thread holds the GIL the loop needs, so it
only swaps the report out and pickles it. Callers hold the engine host's condition around every
method.
"""

from __future__ import annotations

from cluster.group_messages import EngineLoad, GroupReport
from worker.outputs import extend_event, merge_events


class ReportBuffer:
    """One :class:`GroupReport` under construction."""

    def __init__(self) -> None:
        self.report = GroupReport()
        self._rows: dict[str, int] = {}  # request id -> index of its event in report.events
        self._owned: set[str] = set()  # request ids whose event there is a merge this buffer made

    def add(self, part: GroupReport) -> None:
        """Fold what the loop did since its last publish (``part``: events, staged, accepted,
        refused, re-plans) into the report."""
        r, rows, owned = self.report, self._rows, self._owned
        for ev in part.events:
            rid = ev.request_id
            i = rows.get(rid)
            if i is None:
                rows[rid] = len(r.events)
                r.events.append(ev)
            elif rid in owned:  # a merge no one else holds: extended in place
                extend_event(r.events[i], ev)
            else:
                r.events[i] = merge_events((r.events[i], ev))
                owned.add(rid)
        r.staged.update(part.staged)
        r.accepted.extend(part.accepted)
        r.refused.extend(part.refused)
        r.replans.extend(part.replans)

    def set_load(self, load: EngineLoad, applied: int) -> None:
        """The engine's load as of command batch ``applied`` (the two always from one moment)."""
        self.report.load, self.report.applied = load, applied

    def take(self) -> GroupReport:
        """The report so far; the buffer starts a new one."""
        report = self.report
        self.report, self._rows, self._owned = GroupReport(), {}, set()
        return report


def load_is_stale(report: GroupReport, part: GroupReport, applied: int, ended: bool) -> bool:
    """Whether the load must be taken again for ``report`` after the loop's ``part``: it has none yet,
    or something besides decoding changed it (a request ended, commands were applied, anything but
    events happened). Decode steps into a report not yet taken (a reader that lags: the loop is
    host-bound) keep the load it has, paired with the batches applied when it was taken."""
    return (report.load is None or ended or report.applied != applied or bool(part.staged or part.accepted
            or part.refused or part.replans) or not part.events)
