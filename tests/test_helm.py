"""The Helm chart (helm/graphfleet) rendered by a real Helm 3 and validated.

Core kinds go through kubernetes-validate (strict), the RayService through KubeRay's CRD schema,
serveConfigV2 through Ray Serve's own schema and graphfleet's config loader; values.schema.json
must mirror the config dataclasses and reject bad values.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from deploy.config import Config
from tests.crd_schema import crd_validator, errors
from tests.tooling import (
    CASES,
    CHART,
    MULTI_GROUP_VALUES,
    REPO,
    by_kind,
    helm_template,
    rendered_case,
    run,
    shutdown_budget,
    tool,
)

KUBERAY_CRDS = REPO.parent / "shared" / "reference" / "kuberay"
@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return rendered_case(request.param)


def _containers(rayservice: dict) -> dict[str, dict]:
    """The Ray container of the head ("head") and of each worker group (by group name)."""
    spec = rayservice["spec"]["rayClusterConfig"]
    out = {"head": spec["headGroupSpec"]["template"]["spec"]["containers"][0]}
    for g in spec["workerGroupSpecs"]:
        out[g["groupName"]] = g["template"]["spec"]["containers"][0]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_helm_lint_strict(name):
    out = run([tool("helm"), "lint", "--strict", str(CHART), *[a for v in CASES[name] for a in ("-f", str(v))]])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_core_kinds_validate_strict(case):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    _, _, docs = case
    core = [d for d in docs if d["apiVersion"] == "v1"]
    assert {d["kind"] for d in core} == {"Service", "ConfigMap"}
    for doc in core:
        try:
            kubernetes_validate.validate(doc, latest_version(), strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")


def test_rayservice_matches_kuberay_crd(case):
    crd = KUBERAY_CRDS / "ray.io_rayservices.yaml"
    if not crd.is_file():
        pytest.skip(f"KubeRay CRDs not found at {KUBERAY_CRDS} (the shared reference folder beside the repo)")
    _, _, docs = case
    (rayservice,) = by_kind(docs, "RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    validator = crd_validator(crd, "v1")
    assert errors(validator, rayservice) == []
    bad = json.loads(json.dumps(rayservice))
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["startupProbe"] = {
        "failureThreshold": "many"}
    assert any("failureThreshold" in e for e in errors(validator, bad)), "the CRD check must catch a bad probe"


def test_serve_config_builds_the_values_config(case):
    from ray.serve.schema import ServeDeploySchema

    from deploy.serve_app import build_config
    from fleet.config import apply_fleet_options, group_layout, role_tp_size

    _, values, docs = case
    (rayservice,) = by_kind(docs, "RayService")
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "deploy.serve_app:app_builder"
    assert serve_config["http_options"]["port"] == values["config"]["serve"]["port"]
    config = build_config(app["args"])
    assert config == Config.from_dict(values["config"])

    # One worker group per role, one pod per graphfleet group, ceil(tp x gpus_per_rank) GPUs per pod.
    config, fleet = apply_fleet_options(config)
    layout = group_layout(config.cluster, fleet.name)
    groups = {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {role for _, role in layout}
    for role, group in groups.items():
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == \
            sum(r == role for _, r in layout)
        gpus = str(math.ceil(role_tp_size(config.cluster, role) * config.cluster.gpus_per_rank))
        res = group["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == gpus
        assert group["rayStartParams"]["num-gpus"] == gpus
    assert rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def test_multi_group_pods_get_their_role_settings():
    docs = helm_template([MULTI_GROUP_VALUES])
    (rayservice,) = by_kind(docs, "RayService")
    groups = {g["groupName"]: g["template"]["spec"] for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert groups["prefill"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert groups["decode"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
    assert "podAntiAffinity" in groups["decode"]["affinity"] and "affinity" not in groups["prefill"]
    assert groups["prefill"]["containers"][0]["resources"]["limits"]["cpu"] == "16"
    assert groups["decode"]["containers"][0]["resources"]["limits"]["cpu"] == "8"
    for spec in groups.values():
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert spec["containers"][0]["env"] == [{"name": "NCCL_DEBUG", "value": "WARN"}]
        assert spec["containers"][0]["image"] == "registry.example.com/graphfleet:0.1.0-cu128"
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]


def test_startup_probe_budget(case):
    """failureThreshold x periodSeconds covers ceil(safety x (ray start + load + JIT + capture)), by < one period."""
    _, values, docs = case
    s = values["startup"]
    budget = math.ceil(s["safetyFactor"] * (s["rayStartSeconds"] + s["weightLoadSeconds"] + s["kernelJitSeconds"]
                                            + s["graphCaptureSeconds"]))
    # A start that cannot finish fails inside the fleet (cluster.start_timeout_s) before the probe restarts pods.
    assert values["config"]["cluster"]["start_timeout_s"] < budget
    (rayservice,) = by_kind(docs, "RayService")
    containers = _containers(rayservice)
    head = containers.pop("head")
    # KubeRay deploys the Serve app only once the head is Ready: its probes must not wait for the app.
    assert "startupProbe" not in head
    assert head["readinessProbe"]["httpGet"]["path"] == "/api/healthz"
    assert {"name": "serve", "containerPort": values["config"]["serve"]["port"]} in head["ports"]
    for name, c in containers.items():
        probe = c["startupProbe"]
        window = probe["failureThreshold"] * probe["periodSeconds"]
        assert budget <= window < budget + probe["periodSeconds"], (name, budget, probe)
        assert probe["exec"]["command"][-1].endswith(f"http://${{FQ_RAY_IP}}:{values['config']['serve']['port']}/health")
        assert c["livenessProbe"]["httpGet"]["path"] == "/api/healthz"
        assert "/-/healthz" in c["readinessProbe"]["exec"]["command"][-1]


# ----- probes: liveness follows the replica, readiness follows the fleet -----

def _serve_recovery_s(values: dict) -> int:
    """Serve's own replacement of a replica that stops answering, as values.yaml's `probes` comment defines it."""
    i = values["ingress"]
    return math.ceil(3 * (i["healthCheckPeriodS"] + i["healthCheckTimeoutS"]) + shutdown_budget(values)[0])


def test_probes_per_pod(case):
    """The head (the only Serve proxy) is live while Ray is and the replica answers /live through it, and
    Ready on Ray alone (KubeRay deploys the app only to a Ready head); workers are live on Ray alone, Ready
    with Ray and a local proxy (KubeRay's serve Service), and started once the fleet's /health passes."""
    _, values, docs = case
    port, agent = values["config"]["serve"]["port"], values["probes"]["dashboardAgentPort"]
    (rayservice,) = by_kind(docs, "RayService")
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"])["proxy_location"] == "HeadOnly"
    containers = _containers(rayservice)
    head = containers.pop("head")

    live, p = head["livenessProbe"], values["probes"]["replicaLiveness"]
    assert live["exec"]["command"][:2] == ["bash", "-c"]
    script = live["exec"]["command"][2]
    assert f"http://localhost:{agent}/api/healthz" in script
    assert f"http://127.0.0.1:{port}/live" in script and "/health" not in script.replace("/api/healthz", "")
    assert f"--header 'x-request-timeout-seconds: {p['timeoutSeconds']}'" in script
    assert (live["periodSeconds"], live["failureThreshold"]) == (p["periodSeconds"], p["failureThreshold"])
    assert live["timeoutSeconds"] == 2 * p["timeoutSeconds"] + 2  # two checks of timeoutSeconds (+1) each
    assert live["periodSeconds"] * live["failureThreshold"] > _serve_recovery_s(values)
    r = values["probes"]["readiness"]
    assert head["readinessProbe"] == {"httpGet": {"path": "/api/healthz", "port": agent}, "periodSeconds":
                                      r["periodSeconds"], "timeoutSeconds": r["timeoutSeconds"],
                                      "failureThreshold": r["failureThreshold"]}
    assert "startupProbe" not in head
    assert {"name": "serve", "containerPort": port} in head["ports"]

    w = values["probes"]["liveness"]
    for name, c in containers.items():
        assert not any(pt.get("name") == "serve" for pt in c["ports"]), name
        assert c["livenessProbe"] == {"httpGet": {"path": "/api/healthz", "port": agent}, "periodSeconds":
                                      w["periodSeconds"], "timeoutSeconds": w["timeoutSeconds"],
                                      "failureThreshold": w["failureThreshold"]}, name
        ready = c["readinessProbe"]["exec"]["command"][-1]
        assert f"localhost:{agent}/api/healthz" in ready and f"http://localhost:{port}/-/healthz" in ready, name
        assert c["startupProbe"]["exec"]["command"][-1].endswith(f"http://${{FQ_RAY_IP}}:{port}/health"), name
        assert "/live" not in json.dumps(c), name


@pytest.mark.parametrize("sets, minimum", [
    (["probes.replicaLiveness.failureThreshold=27"], 28),  # 270 s: not more than Serve's 270 s
    (["probes.replicaLiveness.periodSeconds=4"], 68),      # 240 s
    (["ingress.healthCheckTimeoutS=200"], 70),             # Serve's recovery grows to 3 x 210 + 60 = 690 s
])
def test_head_liveness_window_must_exceed_serves_recovery(sets, minimum):
    """A head liveness window (failureThreshold x periodSeconds) no longer than Serve's own recovery of a stuck
    replica does not render: the error names the values and the failureThreshold that would do."""
    out = run([tool("helm"), "template", "gf", str(CHART), *[a for s in sets for a in ("--set", s)]])
    assert out.returncode != 0, f"{sets} rendered"
    assert "probes.replicaLiveness: failureThreshold x periodSeconds" in out.stderr, out.stderr
    assert f"raise probes.replicaLiveness.failureThreshold to {minimum} or more" in out.stderr, out.stderr
    fixed = [*sets, f"probes.replicaLiveness.failureThreshold={minimum}"]
    (rayservice,) = by_kind(helm_template(sets=fixed), "RayService")
    assert _containers(rayservice)["head"]["livenessProbe"]["failureThreshold"] == minimum


def test_a_longer_drain_needs_a_longer_head_liveness_window(tmp_path):
    override = tmp_path / "drain.yaml"
    override.write_text(yaml.safe_dump({"config": {"serve": {"drain_timeout_s": 600.0}}}))
    out = run([tool("helm"), "template", "gf", str(CHART), "-f", str(override)])
    assert out.returncode != 0 and "= 840 s" in out.stderr, out.stderr  # 3 x (10 + 60) + ceil(600 + 30)
    helm_template([override], sets=["probes.replicaLiveness.failureThreshold=85"])


class _Stub:
    """A real HTTP server on a free loopback port whose GET answers ``status`` (None: never answers);
    ``headers`` keeps the request headers it saw."""

    def __init__(self, status: int | None = 200) -> None:
        import http.server
        import threading

        stub = self
        self.status, self.headers, self.release = status, [], threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                stub.headers.append(dict(self.headers))
                if stub.status is None:
                    stub.release.wait(30)
                    return
                self.send_response(stub.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("answer, passes", [
    (200, True),    # the replica answered /live
    (404, True),    # no route: KubeRay has not deployed the app yet
    (503, True),    # Serve: the app failed to deploy (a head restart fixes nothing)
    (408, False),   # Serve: the replica did not answer within x-request-timeout-seconds
    (500, False),
    (502, False),
    (None, False),  # the proxy took the connection and never answered
    ("refused", True),  # nothing listens: the app is not deployed yet
    ("ray down", False),  # the replica answers but Ray's own health fails
])
def test_head_liveness_command_against_a_real_http_server(answer, passes):
    """The head's rendered liveness command, run by bash with wget, against real HTTP servers standing in for
    the dashboard agent and the Serve proxy: it fails only when Ray is unhealthy or the replica does not answer
    (408, a 5xx but 503, no answer), and within the probe's timeoutSeconds."""
    import subprocess
    import time

    from tests.serve_harness import free_port

    agent = _Stub(500 if answer == "ray down" else 200)
    proxy = None if answer == "refused" else _Stub(200 if answer == "ray down" else answer)
    port = proxy.port if proxy else free_port()
    try:
        sets = [f"config.serve.port={port}", f"probes.dashboardAgentPort={agent.port}",
                "probes.replicaLiveness.timeoutSeconds=1"]
        (rayservice,) = by_kind(helm_template(sets=sets), "RayService")
        probe = _containers(rayservice)["head"]["livenessProbe"]
        started = time.monotonic()
        done = subprocess.run(probe["exec"]["command"], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                              timeout=60)
        took = time.monotonic() - started
    finally:
        agent.close()
        if proxy:
            proxy.close()
    assert (done.returncode == 0) is passes, (done.returncode, done.stdout, done.stderr)
    assert took < probe["timeoutSeconds"], took
    if proxy and answer != "ray down":
        assert proxy.headers and proxy.headers[0].get("x-request-timeout-seconds") == "1", proxy.headers
    if not passes:
        assert ("Ray is not healthy" if answer == "ray down" else "the replica did not answer GET /live") \
            in done.stdout, done.stdout


def test_dashboards_configmap_carries_every_dashboard(case):
    _, values, docs = case
    (cm,) = by_kind(docs, "ConfigMap")
    for key, value in values["grafanaDashboards"]["labels"].items():
        assert cm["metadata"]["labels"][key] == value
    shipped = {p.name: json.loads(p.read_text()) for p in (REPO / "deploy" / "grafana").glob("*.json")}
    assert shipped and {k: json.loads(v) for k, v in cm["data"].items()} == shipped


def test_monitors_select_what_the_chart_exposes():
    docs = helm_template([MULTI_GROUP_VALUES])
    (svc,) = by_kind(docs, "Service")
    (sm,) = by_kind(docs, "ServiceMonitor")
    (pm,) = by_kind(docs, "PodMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    (rayservice,) = by_kind(docs, "RayService")
    spec = rayservice["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for pod in pods:
        assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert any(p["name"] == "metrics" for p in pod["spec"]["containers"][0]["ports"])
    assert svc["spec"]["selector"].items() <= pods[0]["metadata"]["labels"].items()
    assert by_kind(helm_template(), "ServiceMonitor") == []
