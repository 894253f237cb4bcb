"""A group leader's reports: one event per request however many steps a report covers.

In process on the CPU: a real engine host over a real worker, read the way the report link's
thread reads it (``take_report``), once by a reader that keeps up and once by one that lags the
whole run; both must give every request exactly the in-process engine's tokens and text.
"""

from __future__ import annotations

import threading
import time

import pytest

from cluster.engine_host import EngineHost
from cluster.group_messages import Admit
from cluster.step_channel import LeaderExecutor
from deploy.config import load_config
from worker.engine import Engine
from worker.sampling.params import SamplingParams
from worker.worker import Worker

PROMPTS = [[11, 57, 300, 42, 9], [810, 77, 5], [123, 64, 31, 999, 8, 250]]
MAX_TOKENS = [12, 5, 9]


@pytest.fixture(scope="module")
def config(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    return load_config(None, [f"model.path={path}", "model.device=cpu", "attention.backend=torch",
                              "graphs.enabled=false", "cache.num_pages=128"])


@pytest.fixture(scope="module")
def expected(config):
    engine = Engine(config)
    outs = [engine.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
            for p, n in zip(PROMPTS, MAX_TOKENS)]
    return {f"r{i}": (o.token_ids, o.text) for i, o in enumerate(outs)}


def _run(config, take_every_s: float | None) -> list[list]:
    """The reports' events of one run: taken as they come (``take_every_s`` None), or, for a
    lagging reader, only once every request has finished."""
    worker = Worker.local(config)
    host = EngineHost(config, LeaderExecutor(worker, None), "colocated", worker.max_len, lambda *a: None,
                      lambda *a: None, lambda *a: None)
    loop = threading.Thread(target=host.run, daemon=True)
    loop.start()
    host.put(1, [Admit(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), 0, [], [], False)
                 for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))])
    reports, finished, deadline = [], set(), time.monotonic() + 60
    try:
        if take_every_s is not None:  # lag: let the engine run every request to its end first
            while host.engine.has_unfinished() or host._applied < 1:
                assert time.monotonic() < deadline
                time.sleep(take_every_s)
        while len(finished) < len(PROMPTS):
            assert time.monotonic() < deadline, f"finished only {finished}"
            report = host.take_report(0.5)
            assert report.loop_error is None, report.loop_error
            if report.events:
                reports.append(report.events)
            finished |= {ev.request_id for ev in report.events if ev.finished}
    finally:
        host.stop()
        loop.join(10)
    return reports


@pytest.mark.parametrize("lagging", [False, True], ids=["keeps-up", "lags"])
def test_every_report_has_one_event_per_request_with_all_its_tokens(config, expected, lagging):
    reports = _run(config, 0.05 if lagging else None)
    got: dict[str, tuple[list, str]] = {}
    for events in reports:
        ids = [ev.request_id for ev in events]
        assert len(ids) == len(set(ids)), f"a request has two events in one report: {ids}"
        for ev in events:
            tokens, text = got.get(ev.request_id, ([], ""))
            got[ev.request_id] = (tokens + ev.token_ids, text + ev.text)
            assert ev.finished == (len(got[ev.request_id][0]) == MAX_TOKENS[int(ev.request_id[1:])])
            if ev.finished:
                assert ev.finish_reason == "length"
    assert got == expected
    if lagging:  # one report carried the whole run, requests in the order of their first tokens
        assert len(reports) == 1 and [ev.request_id for ev in reports[0]] == ["r0", "r1", "r2"]


def test_merged_events_keep_every_token_logprob_and_the_last_finish():
    from worker.outputs import FailureKind, RequestEvent, merge_events

    a = RequestEvent("r", [1], "a", False, phases=(0.5, 0.25))
    b = RequestEvent("r", [2, 3], "bc", False, logprobs=[-0.1, -0.2])
    c = RequestEvent("r", [4], "d", True, "error", [-0.3], error="boom", failure=FailureKind.GROUP_FAILED)
    m = merge_events([a, b, c])
    assert (m.token_ids, m.text, m.logprobs, m.finished, m.finish_reason, m.error, m.failure, m.phases) == (
        [1, 2, 3, 4], "abcd", [-0.1, -0.2, -0.3], True, "error", "boom", FailureKind.GROUP_FAILED, (0.5, 0.25))
    assert merge_events([a, a]).logprobs is None and a.token_ids == [1], "the events merged are left as they were"
    assert merge_events([b]) is b


def test_an_owned_merge_is_extended_in_place_as_merge_events_would():
    from worker.outputs import RequestEvent, extend_event, merge_events

    events = [RequestEvent("r", [1], "a", False, phases=(1.0, 2.0)), RequestEvent("r", [2], "b", False),
              RequestEvent("r", [3, 4], "cd", False, logprobs=[-1.0, -2.0]),
              RequestEvent("r", [5], "e", True, "length", [-3.0])]
    into = merge_events(events[:2])
    for ev in events[2:]:
        extend_event(into, ev)
    assert into == merge_events(events)
    assert events[0].token_ids == [1] and events[2].logprobs == [-1.0, -2.0], "only the merge result changed"
