"""Helpers of the Serve tests: free ports, plain HTTP calls, health polling, ``/metrics`` parsing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

#: Config overrides of every test app: the tiny checkpoint on CPU, small cache and graph ladders.
OVERRIDES = ["model.device=cpu", "graphs.debug=true", "cache.num_pages=128", "scheduler.max_running_requests=8",
             "scheduler.chunked_prefill_size=512", "graphs.prefill.max_tokens=512",
             "graphs.decode.max_batch_size=8", "cluster.step_timeout_s=60", "cluster.start_timeout_s=120"]


def start_local_serve(args: dict, app_name: str, num_cpus: int = 16, direct_ingress: bool = False) -> str:
    """Start a local Ray (127.0.0.1) and Serve on a free port, run the app of ``app_builder(args)`` at "/",
    wait until it is healthy; its base URL. The caller ends it with ``serve.shutdown(); ray.shutdown()``.

    With ``direct_ingress`` the app's replica serves HTTP itself, as under ``graphfleet serve``, and
    the URL is the replica's; the Ray started here keeps that environment, and this process drops it
    again once Ray is up (the next module's Ray starts without it).
    """
    import ray
    from ray import serve

    from deploy.ray_cluster import direct_ingress_env, proxy_port
    from deploy.serve_app import app_builder

    port = free_port()
    env = direct_ingress_env(port) if direct_ingress else {}
    os.environ.update(env)
    try:
        ray.init(_node_ip_address="127.0.0.1", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port(port) if direct_ingress else port})
    finally:
        for name in env:
            os.environ.pop(name, None)
    serve.run(app_builder(args), name=app_name, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    return base


def host_port(base: str) -> tuple[str, int]:
    """(host, port) of a base URL ``http://host:port``."""
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | str | dict | None = None, headers: dict | None = None):
    """(status, parsed JSON or text, headers) of one request; never raises on HTTP errors."""
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw, hdrs = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), dict(e.headers)
    try:
        return status, json.loads(raw), hdrs
    except ValueError:
        return status, raw.decode(), hdrs


def wait_healthy(base: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        status, body, _ = http("GET", f"{base}/health")
        if status == 200:
            return
        assert status in (404, 503), (status, body)  # 404: Serve has no route yet
        assert time.monotonic() < end, f"not healthy after {timeout_s}s: {status} {body}"
        time.sleep(0.1)


def scrape(base: str) -> dict[str, list[tuple[dict, float]]]:
    """``/metrics`` as {sample name: [(labels, value), ...]}; asserts each family is declared once."""
    status, text, _ = http("GET", f"{base}/metrics")
    assert status == 200, text
    declared = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(declared) == len(set(declared)), sorted(d for d in declared if declared.count(d) > 1)
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return samples


def total(samples: dict, name: str, **match: str) -> float:
    """Sum of the ``name`` samples whose labels include ``match``."""
    return sum(v for labels, v in samples.get(name, []) if all(labels.get(k) == x for k, x in match.items()))


#: GET /health every 20 ms on one kept-alive connection until stdin closes; one line per answer:
#: "<monotonic start> <seconds> <status>". A process of its own, so the test's own threads (stream
#: readers, senders) cannot delay it.
_POLL = """
import http.client, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
conn = http.client.HTTPConnection(host, port, timeout=30)
while not done.is_set():
    started = time.monotonic()
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    print(started, time.monotonic() - started, resp.status, flush=True)
    time.sleep(0.02)
"""


class HealthPoller:
    """Polls /health from a process of its own (:data:`_POLL`); ``stop()`` returns (when, seconds, status)s."""

    def __init__(self, base: str) -> None:
        host, port = host_port(base)
        self.proc = subprocess.Popen([sys.executable, "-c", _POLL, host, str(port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[float, float, int]]:
        out, _ = self.proc.communicate(input="", timeout=30)
        return [(float(a), float(b), int(c)) for a, b, c in (line.split() for line in out.splitlines())]
