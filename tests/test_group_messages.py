"""cluster.group_messages: a group's report crosses the process boundary intact, events as columns."""

from __future__ import annotations

import pickle

from ray import cloudpickle

from cluster.group_messages import EngineLoad, GroupReport, Refused, Staged
from worker.outputs import FailureKind, RequestEvent, events_from_wire, events_to_wire


def test_a_report_round_trips_through_ray_pickling():
    events = [RequestEvent("a#0", [5, 6], "hi", False),
              RequestEvent("b#1", [7], " there", True, "stop", [-0.5], stop_reason="\n\n"),
              RequestEvent("b#2", [9], "", True, "stop", stop_reason=9),
              RequestEvent("c#0", [], "", True, "error", None, "group lost", FailureKind.GROUP_FAILED)]
    report = GroupReport(events, {"d#0": Staged("t1", 3, 40)}, ["e#0"], [Refused("f#0", "no_room", "full")],
                         EngineLoad(10, 20, 3, 400), applied=7, step_s=0.25, loop_error=None)
    back = pickle.loads(cloudpickle.dumps(report))
    assert back == report and back.events[3].failure is FailureKind.GROUP_FAILED
    assert pickle.loads(cloudpickle.dumps(GroupReport())) == GroupReport()
    assert events_from_wire(events_to_wire(events)) == events
