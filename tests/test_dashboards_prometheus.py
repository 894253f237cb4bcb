"""Grafana dashboards (deploy/grafana) against a real Prometheus scraping a real ``graphfleet serve``.

The serve runs on CPU with ``graphs.debug=true``: the debug backend takes every pass through the
graph runner (static buffers, bucket choice, padding) without a CUDA graph, so every ``cuda_graph_*``
series a GPU rank exports exists here too, with zero graph memory and an unbounded (0) budget. Every
expression of every panel must therefore return data: none is excused on CPU.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.tooling import REPO, tool

DASHBOARDS = {p.name: json.loads(p.read_text()) for p in sorted((REPO / "deploy" / "grafana").glob("*.json"))}
RULE_FILES = [REPO / "deploy" / "prometheus" / f for f in ("graphfleet-rules.yaml", "graphfleet-thresholds.yaml")]
# What Grafana puts in for $__rate_interval; the traffic below runs well inside this window.
RATE_WINDOW = "45s"
SERVE_OVERRIDES = ["model.device=cpu", "graphs.debug=true", "cache.num_pages=128", "scheduler.max_running_requests=8",
                   "scheduler.chunked_prefill_size=512", "graphs.prefill.max_tokens=512",
                   "graphs.decode.max_batch_size=8", "scheduler.max_waiting_requests=2"]
_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def _targets(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard."""
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def _concrete(expr: str) -> str:
    """``expr`` as Grafana sends it with every variable at "All" (``.*``)."""
    return _VAR.sub(lambda m: RATE_WINDOW if (m[1] or m[2]) == "__rate_interval" else ".*", expr)


def _metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:cuda_graph|graphfleet_api|prompt|generation|request|time_to|inter_token|e2e|"
                          r"num_requests|kv_cache)\w*)", expr))


# ----- the dashboards as files -----

@pytest.mark.parametrize("name", list(DASHBOARDS))
def test_dashboard_is_grafana_10_json(name):
    dash = DASHBOARDS[name]
    assert dash["schemaVersion"] >= 38 and dash["uid"] and dash["title"]  # 38: Grafana 10.0
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for m in _VAR.finditer(target["expr"]):
                var = m[1] or m[2]
                assert var == "__rate_interval" or var in variables, (panel["title"], var)
                if var != "__rate_interval":  # "All" is the regex .*: a variable only ever goes in =~
                    assert f'=~"{m[0]}"' in target["expr"], (panel["title"], var)


def test_dashboards_have_unique_uids():
    assert len({d["uid"] for d in DASHBOARDS.values()}) == len(DASHBOARDS) == 2


# ----- a live serve scraped by a live Prometheus -----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _wait(check, what: str, timeout_s: float, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the process exited with {proc.returncode}")
        assert time.monotonic() < end, f"{what}: not after {timeout_s:.0f}s"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def serve(checkpoint_dir, tmp_path_factory):
    """Base URL of ``graphfleet serve`` (CPU) on a free loopback port."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "deploy", "serve", "--model", str(checkpoint_dir("tiny-llama")),
           "--host", "127.0.0.1", "--port", str(port), *[a for o in SERVE_OVERRIDES for a in ("--set", o)]]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _get(f"{base}/health")[0] == 200, f"graphfleet serve ({log})", 180, proc)
        yield base
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def prometheus(serve, tmp_path_factory):
    """Base URL of a Prometheus scraping the serve's /metrics every second, with deploy/prometheus loaded."""
    binary = tool("prometheus")
    root = tmp_path_factory.mktemp("prometheus")
    target = urllib.parse.urlparse(serve).netloc
    config = root / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [{"job_name": "graphfleet", "static_configs": [{"targets": [target]}]}],
    }))
    port = _free_port()
    with open(root / "prometheus.log", "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _get(f"{base}/-/ready")[0] == 200, "prometheus ready", 60, proc)
        _wait(lambda: _query(base, 'up{job="graphfleet"} == 1'), "prometheus scraping graphfleet serve", 30, proc)
        yield base
    finally:
        _stop(proc)


def _query(base: str, expr: str) -> list[dict]:
    status, body = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert status == 200, f"{expr}: {body}"
    return json.loads(body)["data"]["result"]


def _has_data(result: list[dict]) -> bool:
    return any(r["value"][1] not in ("NaN", "+Inf", "-Inf") for r in result)


@pytest.fixture(scope="module")
def scraped(serve, prometheus):
    """The Prometheus URL once it has scraped a few seconds of mixed traffic (streamed and not,
    completions and chat, and a burst that overflows the 2-request queue into 429s)."""
    stream_body = {"prompt": "The fleet of graphs sails at dawn and", "max_tokens": 12, "stream": True,
                   "ignore_eos": True}
    for i in range(8):
        assert _post(f"{serve}/v1/completions", stream_body) == 200
        assert _post(f"{serve}/v1/completions", {"prompt": f"Hello {i}", "max_tokens": 6}) == 200
        assert _post(f"{serve}/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 4}) == 200
        time.sleep(0.6)
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda _: _post(f"{serve}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 48,
                                                                             "ignore_eos": True}), range(16)))
    assert 429 in statuses and set(statuses) <= {200, 429}, statuses
    threading.Event().wait(3)  # a few more scrapes after the last request
    return prometheus


def test_every_panel_returns_data(scraped):
    missing = []
    for name, dash in DASHBOARDS.items():
        for title, expr in _targets(dash):
            if not _has_data(_query(scraped, _concrete(expr))):
                missing.append(f"{name} / {title}: {sorted(_metrics(expr))}\n    {_concrete(expr)}")
    assert not missing, "panels without data (metrics not exported by graphfleet serve?):\n" + "\n".join(missing)


def test_every_variable_has_values(scraped):
    missing = []
    for name, dash in DASHBOARDS.items():
        for var in dash["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
            selector, label = m[1], m[2]
            result = _query(scraped, f"count by ({label}) ({_concrete(selector)})")
            if not any(r["metric"].get(label) for r in result):
                missing.append(f"{name} ${var['name']}: {var['query']['query']}")
    assert not missing, "variables without values:\n" + "\n".join(missing)


def test_rules_evaluate_on_live_metrics(scraped):
    """The recording rules produce series from the real /metrics, and with a ready colocated group
    GraphfleetNoReadyDecodeGroup stays quiet."""
    _wait(lambda: _query(scraped, "graphfleet:generation_tokens:rate5m > 0"), "generation rate recorded", 10)
    for record in ("graphfleet:cuda_graph_passes:rate5m", "graphfleet:time_to_first_token_seconds:p99_5m",
                   "graphfleet:cuda_graph_memory_bytes:sum"):
        assert _has_data(_query(scraped, record)), record
    ready = _query(scraped, "graphfleet:decode_groups_ready:count")
    assert [r["value"][1] for r in ready] == ["1"], ready
    assert _query(scraped, 'ALERTS{alertname="GraphfleetNoReadyDecodeGroup"}') == []
