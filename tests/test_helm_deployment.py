"""The chart's Serve deployment and its shutdown (helm/graphfleet rendered by a real Helm 3): the
deployment's options as ``graphfleet serve`` builds them, the drain budget every pod's grace period
and preStop hook follow, and the worker's preStop run against a real HTTP server."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.tooling import CASES, by_kind, helm_template, rendered_case, shutdown_budget


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return rendered_case(request.param)


@pytest.mark.parametrize("drain_timeout", [None, 120.5])
def test_shutdown_follows_the_drain_timeout(case, drain_timeout, tmp_path):
    """Serve's graceful_shutdown_timeout_s and the head's preStop wait are drain_timeout_s + margin; every
    pod's grace period covers that plus the worker's head start and Ray's exit; workers wait for the drain."""
    name, values, docs = case
    if drain_timeout is not None:
        values = json.loads(json.dumps(values))
        values["config"]["serve"]["drain_timeout_s"] = drain_timeout
        override = tmp_path / "drain.yaml"  # --set would pass 120.5 as a string
        override.write_text(yaml.safe_dump({"config": {"serve": {"drain_timeout_s": drain_timeout}}}))
        docs = helm_template([*CASES[name], override])
    budget, grace = shutdown_budget(values)
    assert budget > values["config"]["serve"]["drain_timeout_s"] and grace > budget
    (rayservice,) = by_kind(docs, "RayService")
    [deployment] = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["deployments"]
    assert deployment["graceful_shutdown_timeout_s"] == budget
    assert deployment["max_ongoing_requests"] == values["config"]["serve"]["max_ongoing_requests"] == 100_000
    spec = rayservice["spec"]["rayClusterConfig"]
    pods = {"head": spec["headGroupSpec"]["template"]["spec"]}
    pods.update({g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]})
    assert {n: p["terminationGracePeriodSeconds"] for n, p in pods.items()} == {n: grace for n in pods}
    head = pods.pop("head")["containers"][0]
    assert head["lifecycle"]["preStop"]["exec"]["command"] == ["graphfleet", "drain", "--wait-s", str(budget)]
    for pod in pods.values():
        command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["bash", "-c"] and f"${{FQ_RAY_IP}}:{values['config']['serve']['port']}/health" \
            in command[2] and f"+ {budget}))" in command[2]


@pytest.mark.parametrize("serve_loop", [False, True])
def test_the_replica_actor_options_follow_the_config(serve_loop):
    """The chart renders the ingress replica's actor options as ``deployment_options`` builds them for
    ``graphfleet serve``: one CPU, and the API on Serve's own loop only under serve.api_on_serve_loop."""
    from deploy.config.schema import ServeConfig
    from deploy.serve_app import SERVE_LOOP_ENV, deployment_options

    docs = helm_template(sets=[f"config.serve.api_on_serve_loop={str(serve_loop).lower()}"])
    (rayservice,) = by_kind(docs, "RayService")
    [deployment] = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["deployments"]
    options = deployment_options(ServeConfig(api_on_serve_loop=serve_loop))["ray_actor_options"]
    assert deployment["ray_actor_options"] == options
    assert options.get("runtime_env", {}).get("env_vars") == (SERVE_LOOP_ENV if serve_loop else None)


def test_worker_prestop_waits_while_the_app_drains(tmp_path):
    """The worker's preStop (rendered, run by bash with wget) against a real HTTP server: it returns at
    once after the head start while the app is ready, and only once a draining app has stopped."""
    import http.server
    import subprocess
    import threading
    import time

    status = {"now": "ready"}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": status["now"], "groups": {}}).encode()
            self.send_response(200 if status["now"] == "ready" else 503)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        docs = helm_template(sets=["shutdown.workerHeadStartSeconds=1", f"config.serve.port={port}"])
        (rayservice,) = by_kind(docs, "RayService")
        [group] = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        command = group["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        env = {"FQ_RAY_IP": "127.0.0.1", "PATH": "/usr/bin:/bin"}

        def run_prestop() -> float:
            started = time.monotonic()
            subprocess.run(command, env=env, timeout=60, check=True)
            return time.monotonic() - started

        assert 1 <= run_prestop() < 5  # ready: only the head start
        status["now"] = "draining"
        threading.Timer(4, lambda: status.update(now="stopped")).start()
        assert 4 <= run_prestop() < 10  # waited for the drain to end
    finally:
        server.shutdown()
