"""Limits and the life of the OpenAI app on a real local Ray Serve (CPU): pages freed at once when
clients go away (queued, in hand-off, decoding), overload (429) and deadlines (504), failed and waiting
starts, liveness against health, 408 for a replica that does not answer, shutdown and drain, the CLI.
(The API's answers themselves: tests/test_serve.py.)
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import ray
from ray import serve

from deploy.serve_app import app_builder
from tests.serve_harness import OVERRIDES, host_port, scrape, start_local_serve, total, wait_healthy
from tests.serve_harness import http as _http

openai = pytest.importorskip("openai")  # absent on the GPU machine; CI installs it (dev extra)


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return checkpoint_dir("tiny-llama")


@pytest.fixture(scope="module")
def server(path):
    """Base URL of a running Serve with a colocated app at "/"; the tests add their own apps beside it."""
    yield start_local_serve({"model": str(path), "overrides": OVERRIDES, "model_name": "tiny",
                             "fleet": {"name": "life"}}, "graphfleet")
    serve.shutdown()
    ray.shutdown()


class _OpenStream:
    """A streamed completion on a raw socket, read on a thread; :meth:`cut` drops the connection."""

    def __init__(self, server: str, prefix: str, max_tokens: int) -> None:
        import http.client
        import threading

        host, port = host_port(server)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.conn.request("POST", f"{prefix}/v1/completions",
                          json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": max_tokens, "stream": True,
                                      "ignore_eos": True}), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.chunks = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self.resp:
                self.chunks += line.startswith(b"data: ")
        except (OSError, ValueError, AttributeError):  # cut (http.client's response may be closed under us)
            pass

    def cut(self) -> float:
        """Drop the connection as a client going away does; returns when (``time.monotonic()``)."""
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        return time.monotonic()


@pytest.mark.timeout(300)
def test_disconnects_free_pages_at_once_queued_in_handoff_and_decoding(server, path):
    """One slot per group (disaggregated, max_running_requests=1): A decodes on the decode group, B is
    prefilled and its KV waits for that slot (a hand-off), C waits in the queue. Each client goes away in
    turn; each request is aborted at once (within 2 s): it leaves the queue, the hand-off, the decode
    group, and every group's KV usage returns to 0."""
    base = f"{server}/cut"
    app = app_builder({"model": str(path), "overrides": [*OVERRIDES, "scheduler.max_running_requests=1"],
                       "model_name": "tiny", "fleet": {"name": "cut", "mode": "disaggregated"}})
    serve.run(app, name="graphfleet-cut", route_prefix="/cut", blocking=False)
    try:
        wait_healthy(base)
        max_tokens = _http("GET", f"{base}/v1/models")[1]["data"][0]["max_model_len"] - 8

        def health():
            return _http("GET", f"{base}/health")[1]

        def usage():
            return {labels["group"]: v for labels, v in scrape(base).get("kv_cache_usage_ratio", [])}

        def aborted():
            return total(scrape(base), "request_success_total", finish_reason="abort")

        def until(predicate, what, since, within_s=2.0):
            while not predicate():
                assert time.monotonic() - since < 60, f"{what}: {health()} {usage()}"
                time.sleep(0.02)
            took = time.monotonic() - since
            assert took < within_s, f"{what} took {took:.2f}s"
            return took

        a = _OpenStream(server, "/cut", max_tokens)
        until(lambda: a.chunks >= 3, "A decoding", time.monotonic(), 60)
        b = _OpenStream(server, "/cut", max_tokens)
        until(lambda: health()["handoffs"] == 1 and b.chunks >= 1, "B prefilled, its KV waiting", time.monotonic(), 60)
        c = _OpenStream(server, "/cut", max_tokens)
        until(lambda: health()["queued"] == 1, "C queued", time.monotonic(), 60)
        assert health()["in_flight"] == 3 and usage()["cut-d0"] > 0 and usage()["cut-p0"] == 0
        before = aborted()

        took = {"queued": until(lambda: health()["queued"] == 0 and health()["in_flight"] == 2,
                                "C (queued) aborted", c.cut())}
        took["handoff"] = until(lambda: health()["handoffs"] == 0 and health()["in_flight"] == 1,
                                "B (in a hand-off) aborted", b.cut())
        assert health()["queued"] == 0 and usage()["cut-d0"] > 0  # A still decodes
        took["decoding"] = until(lambda: health()["in_flight"] == 0 and set(usage().values()) == {0.0},
                                 "A (decoding) aborted, its pages freed", a.cut())
        until(lambda: aborted() - before == 3, "3 aborts counted", time.monotonic())
        assert _http("GET", f"{base}/health")[0] == 200
        print(f"from disconnect to aborted and freed: {took}")
    finally:
        serve.delete("graphfleet-cut")


# ----- limits on a real fleet: overload (429) and deadlines (504) -----

@pytest.fixture(scope="module")
def limited(server, path):
    """Base URL of a third app: a fleet queueing at most 2 new requests, 1.5 s request deadline."""
    app = app_builder({"model": str(path), "overrides": OVERRIDES, "model_name": "tiny",
                       "request_timeout_s": 1.5, "fleet": {"name": "slim", "max_waiting_requests": 2}})
    serve.run(app, name="graphfleet-lim", route_prefix="/lim", blocking=False)
    wait_healthy(f"{server}/lim")
    yield f"{server}/lim"
    serve.delete("graphfleet-lim")


def test_overload_is_429_with_retry_after_and_deadline_is_504(limited):
    from concurrent.futures import ThreadPoolExecutor

    body = {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True}
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda _: _http("POST", f"{limited}/v1/completions", body), range(32)))
    statuses = [r[0] for r in results]
    overloaded = [r for r in results if r[0] == 429]
    assert overloaded, statuses
    status, err, headers = overloaded[0]
    assert headers["retry-after"] == "1" and err["error"]["type"] == "rate_limit_error"
    assert "overloaded" in err["error"]["message"]
    timed_out = [r for r in results if r[0] == 504]
    assert timed_out and "deadline" in timed_out[0][1]["error"]["message"], statuses
    assert set(statuses) <= {429, 504}
    client = openai.OpenAI(base_url=f"{limited}/v1", api_key="none", max_retries=0, timeout=60)

    def call(_):
        try:
            client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=1500, extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            return type(e)
        return None

    with ThreadPoolExecutor(32) as pool:
        raised = set(pool.map(call, range(32)))
    assert openai.RateLimitError in raised and raised <= {openai.RateLimitError, openai.InternalServerError}
    status, text, _ = _http("POST", f"{limited}/v1/completions", {**body, "stream": True})
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert "deadline" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
    assert _http("GET", f"{limited}/health")[0] == 200


def test_a_failed_generation_is_504_past_its_deadline_else_500():
    from deploy.errors import generation_failed
    from worker.outputs import FailureKind, RequestEvent

    def failed(failure, error="timeout of the step"):
        return generation_failed(RequestEvent("r", [], "", True, "error", None, error, failure))

    deadline = failed(FailureKind.DEADLINE, "deadline exceeded: not finished 1s after submission")
    assert (deadline.status, deadline.type) == (504, "timeout_error")
    assert deadline.message == "generation failed: deadline exceeded: not finished 1s after submission"
    for kind in set(FailureKind) - {FailureKind.DEADLINE}:
        assert (failed(kind).status, failed(kind).type) == (500, "internal_error")


def test_starting_fleet_reports_a_failed_start(server, path):
    from deploy.serve_app import StartingFleet, build_config

    starting = StartingFleet(build_config({"model": str(path), "overrides": OVERRIDES}), {"num_groups": 2})
    starting.shutdown()  # waits for the start thread
    h = starting.health()
    assert not starting.ready and h["status"] == "dead" and "unknown fleet option 'num_groups'" in h["error"]


def test_health_names_what_a_group_waits_for_within_seconds(server, path):
    """A rank asking for more CPUs than the Ray cluster has (64 of 16): within 10 s ``/health`` says the
    group waits for resources, with what it asked for and what is free; deleting the app ends the wait."""
    app = app_builder({"model": str(path), "overrides": [*OVERRIDES, "cluster.cpus_per_rank=64"], "model_name": "tiny",
                       "fleet": {"name": "huge"}})
    serve.run(app, name="graphfleet-huge", route_prefix="/huge", blocking=False)
    deployed = time.monotonic()
    try:
        while True:
            status, body, _ = _http("GET", f"{server}/huge/health")
            if status == 503 and body.get("waiting"):
                break
            assert status in (404, 503) and time.monotonic() - deployed < 10, (status, body)
            time.sleep(0.1)
        assert body["status"] == "starting" and body["groups"] == {"huge-c0": "starting"}, body
        assert _http("GET", f"{server}/huge/live")[:2] == (200, {"status": "alive"})  # the replica is alive
        waiting = body["waiting"]["huge-c0"]
        assert waiting["state"] == "waiting for resources"
        assert waiting["asked"] == {"bundle": {"CPU": 64.0}, "count": 1}
        assert 0 <= waiting["available"]["CPU"] <= 16
        reported_s = time.monotonic() - deployed
        later = _http("GET", f"{server}/huge/health")[1]["waiting"]["huge-c0"]
        assert later["waiting_s"] >= waiting["waiting_s"]
        print(f"waiting for resources reported {reported_s:.1f}s after the app was deployed")
    finally:
        serve.delete("graphfleet-huge")
    pending = [pg for pg in ray.util.placement_group_table().values()
               if pg["name"].startswith("graphfleet-huge-") and pg["state"] != "REMOVED"]
    assert pending == [], pending


def test_live_follows_the_replica_while_health_follows_the_fleet(server, path):
    """``/live`` is 200 while ``/health`` is 503 for a fleet that is starting (a rank waits for 64 CPUs), then
    draining and stopped (the drain of the chart's preStop, through a deployment handle); the drain refuses API
    requests but not ``/live``."""
    base = f"{server}/alive"
    app = app_builder({"model": str(path), "overrides": [*OVERRIDES, "cluster.cpus_per_rank=64"], "model_name": "tiny",
                       "fleet": {"name": "alive"}})
    serve.run(app, name="graphfleet-alive", route_prefix="/alive", blocking=False)
    try:
        end = time.monotonic() + 60
        while (status := _http("GET", f"{base}/live")[0]) != 200:
            assert status in (404, 503) and time.monotonic() < end, status  # 404/503: Serve has no replica yet
            time.sleep(0.1)
        status, body, _ = _http("GET", f"{base}/health")
        assert status == 503 and body["status"] == "starting", body

        handle = serve.get_deployment_handle("OpenAIIngress", "graphfleet-alive")
        reports: list[dict] = []
        drain = threading.Thread(target=lambda: reports.append(handle.drain.remote(10).result()), daemon=True)
        drain.start()
        seen = set()
        while drain.is_alive():
            status, body, _ = _http("GET", f"{base}/health")
            seen.add((status, body["status"]))
            assert _http("GET", f"{base}/live")[:2] == (200, {"status": "alive"}), seen
            time.sleep(0.05)
        [report] = reports
        assert (report["finished"], report["aborted"]) == (0, 0), report
        status, body, _ = _http("GET", f"{base}/health")
        assert (status, body["status"]) == (503, "stopped") and seen <= {(503, "starting"), (503, "draining"),
                                                                         (503, "stopped")}, (body, seen)
        assert _http("GET", f"{base}/live")[:2] == (200, {"status": "alive"})
        status, body, _ = _http("GET", f"{base}/v1/models")
        assert status == 503 and body["error"]["code"] == "draining", body
    finally:
        serve.delete("graphfleet-alive")


def test_serve_answers_408_for_a_replica_that_does_not_answer_in_time(server, path):
    """What the chart's head liveness relies on: with ``x-request-timeout-seconds`` the Serve proxy answers 408
    when no replica answers in time (here: a replica that never gets the 64 CPUs it asks for)."""
    from deploy.serve_app import build_config, deployment

    config = build_config({"model": str(path), "overrides": OVERRIDES})
    app = deployment(config).options(ray_actor_options={"num_cpus": 64}, graceful_shutdown_timeout_s=1
                                     ).bind(config.to_dict(), {})  # Serve waits that long to kill it
    serve._run(app, _blocking=False, name="graphfleet-nowhere", route_prefix="/nowhere")  # serve.run waits for it
    try:
        end = time.monotonic() + 30
        while True:
            started = time.monotonic()
            status, body, _ = _http("GET", f"{server}/nowhere/live", headers={"x-request-timeout-seconds": "1"})
            if status == 408:
                break
            assert status == 404 and time.monotonic() < end, (status, body)  # the route is not there yet
            time.sleep(0.1)
        assert time.monotonic() - started < 5
    finally:
        serve.delete("graphfleet-nowhere")


@pytest.mark.timeout(300)
def test_serves_own_replica_shutdown_waits_for_the_stream_then_drains_in_del(server, path):
    """Serve's replica shutdown (``serve.delete``; a config update or scale-down does the same) stops routing
    to the replica, waits for the open stream (up to graceful_shutdown_timeout_s = drain + margin), then
    awaits the replica's async ``__del__``, which runs the drain: the stream ended normally, the drain found
    nothing left, and the fleet's placement groups are gone."""
    import http.client
    from pathlib import Path

    app = app_builder({"model": str(path), "overrides": OVERRIDES, "model_name": "tiny", "fleet": {"name": "bye"}})
    serve.run(app, name="graphfleet-bye", route_prefix="/bye", blocking=False)
    wait_healthy(f"{server}/bye")
    host, port = host_port(server)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/bye/v1/completions", json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 200,
                                                            "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    serve.delete("graphfleet-bye")  # returns once the replica has shut down
    events = [line.decode().strip() for line in resp if line.strip()]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    [replica_log] = logs.glob("replica_graphfleet-bye_OpenAIIngress_*.log")
    drained = [line for line in replica_log.read_text().splitlines() if "drained: " in line]
    assert drained and "'finished': 0, 'aborted': 0" in drained[-1], drained
    left = [pg for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith("graphfleet-bye-") and pg["state"] != "REMOVED"]
    assert left == [], left


def test_serves_shutdown_budget_follows_the_drain_timeout(path):
    from deploy.serve_app import SHUTDOWN_MARGIN_S, OpenAIIngress, build_config, deployment

    for drain in (None, 12.5):
        config = build_config({"model": str(path), "overrides": [] if drain is None else
                               [f"serve.drain_timeout_s={drain}"]})
        options = deployment(config)._deployment_config  # Serve keeps the options it will run with here
        assert options.graceful_shutdown_timeout_s == config.serve.drain_timeout_s + SHUTDOWN_MARGIN_S
        assert options.graceful_shutdown_wait_loop_s == 0.5
    # The class's own options are those of the default drain timeout.
    assert OpenAIIngress._deployment_config.graceful_shutdown_timeout_s == 30.0 + SHUTDOWN_MARGIN_S


def test_serves_cap_on_requests_at_once_is_the_configs(path):
    """Serve's max_ongoing_requests is serve.max_ongoing_requests (its default far above the fleet's queue:
    an overload must meet the fleet's 429, not Serve's rejection and its proxy's retry loop)."""
    from deploy.serve_app import OpenAIIngress, build_config, deployment

    default = build_config({"model": str(path)})
    assert deployment(default)._deployment_config.max_ongoing_requests == default.serve.max_ongoing_requests
    assert default.serve.max_ongoing_requests > 10 * default.scheduler.max_waiting_requests
    assert OpenAIIngress._deployment_config.max_ongoing_requests == default.serve.max_ongoing_requests
    small = build_config({"model": str(path), "overrides": ["serve.max_ongoing_requests=6000"]})
    assert deployment(small)._deployment_config.max_ongoing_requests == 6000


def test_cli_serve_parses():
    from deploy.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "/m", "--port", "9000", "--api-key", "k"])
    assert (args.command, args.model, args.port, args.api_key, args.host) == ("serve", "/m", 9000, "k", None)
    assert args.ray_address is None
    args = build_parser().parse_args(["drain", "--ray-address", "10.0.0.5:6379", "--wait-s", "60"])
    assert (args.command, args.ray_address, args.timeout, args.wait_s) == ("drain", "10.0.0.5:6379", None, 60.0)
