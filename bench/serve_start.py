"""Starting the Serve app a bench measures, and waiting until it serves.

:func:`start_app` brings up a local Ray on 127.0.0.1, Serve and graphfleet's app over a checkpoint;
:func:`wait_healthy` waits for its ``/health`` (or another server's, attached with ``--url``), and
gives up early on a group the local cluster can never place (:func:`placement_stuck`);
:func:`gpu_sharing_overrides` lets a disaggregated fleet share fewer GPUs than its ranks.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import torch


def _get(url: str, headers: dict | None = None, timeout: float = 30.0):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def _health_body(body: str) -> dict:
    """A 200 ``/health`` body as a dict: ours is JSON; another server's (``vllm serve``) may be empty or text."""
    if not body.strip():
        return {}
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return {"body": body}
    return parsed if isinstance(parsed, dict) else {"body": parsed}


def wait_healthy(base: str, timeout_s: float, placement_timeout_s: float | None = None) -> dict:
    """``/health`` once it answers 200 (the fleet is up, or a peer server is); raises with the last
    answer after ``timeout_s``, or as soon as a group of ours has waited longer than
    ``placement_timeout_s`` for resources (the local cluster a bench starts never grows)."""
    end, last, shown = time.monotonic() + timeout_s, None, None
    while time.monotonic() < end:
        try:
            status, body = _get(f"{base}/health")
            if status == 200:
                return _health_body(body)
        except OSError as e:  # 404/503 while Serve routes and the fleet starts; refused before
            last = e.read().decode() if getattr(e, "code", None) == 503 else e
        if last is not None and str(last) != shown:
            print(f"waiting for the fleet: {last}", flush=True)
            shown = str(last)
        if placement_timeout_s is not None and isinstance(last, str):
            stuck = placement_stuck(_health_body(last), placement_timeout_s)
            if stuck:
                raise SystemExit(stuck)
        time.sleep(0.5)
    raise SystemExit(f"not healthy after {timeout_s:g}s: {last}")


def placement_stuck(health: dict, timeout_s: float) -> str | None:
    """Why the fleet behind ``health`` (a 503 ``/health`` body) cannot start: a group that has waited
    more than ``timeout_s`` for resources, what it asked and what is free; None if none has."""
    waiting = health.get("waiting") or {}
    for gid, w in sorted(waiting.items()):
        if isinstance(w, dict) and float(w.get("waiting_s", 0.0)) > timeout_s:
            asked = w.get("asked", {})
            return (f"group {gid} has waited {w['waiting_s']}s for resources ({asked.get('count')} x "
                    f"{asked.get('bundle')} asked, {w.get('available')} free): this cluster cannot place it. "
                    "On one GPU, share it: --set cluster.gpus_per_rank=0.5 --set cache.gpu_memory_fraction=0.4")
    return None


def gpu_sharing_overrides(mode: str, gpus: int, overrides: list[str]) -> list[str]:
    """Overrides that let a disaggregated fleet (a prefill and a decode group) fit ``gpus`` visible
    GPUs when its ranks outnumber them: each rank takes a share of a GPU (``cluster.gpus_per_rank``)
    and, unless set, that share of its memory (``cache.gpu_memory_fraction``, 0.8 of the share).
    Nothing when the mode is colocated, there is no GPU, the GPUs suffice, or the user set the share."""
    keys = {o.split("=", 1)[0] for o in overrides}
    if mode != "disaggregated" or gpus < 1 or "cluster.gpus_per_rank" in keys:
        return []
    tp = next((int(o.split("=", 1)[1]) for o in reversed(overrides) if o.startswith("cluster.tp_size=")), 1)
    ranks = 2 * tp
    if gpus >= ranks:
        return []
    share = gpus / ranks
    extra = [f"cluster.gpus_per_rank={share:g}"]
    if "cache.gpu_memory_fraction" not in keys:
        extra.append(f"cache.gpu_memory_fraction={0.8 * share:g}")
    return extra


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(direct_ingress: bool = False) -> int:
    """A local Ray (127.0.0.1) and Serve on a free port of 127.0.0.1; returns the port clients use.

    With ``direct_ingress`` the ingress replica serves HTTP itself (Ray Serve's
    ``RAY_SERVE_ENABLE_DIRECT_INGRESS``: no hop through Serve's proxy, whose process otherwise
    carries every request body and every streamed chunk) on a port of its own, which is returned.
    The flags reach the replica through the environment the local Ray starts with.
    """
    import ray
    from ray import serve

    from deploy.ray_cluster import direct_ingress_env, proxy_port

    replica_port = _free_port() if direct_ingress else None
    if replica_port is not None:
        os.environ.update(direct_ingress_env(replica_port))
    # Every rank and the replica take one logical CPU: a small machine must still place them.
    ray.init(_node_ip_address="127.0.0.1", num_cpus=max(os.cpu_count() or 1, 8),
             num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    port = proxy_port(replica_port) if replica_port is not None else _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return replica_port if replica_port is not None else port


def start_app(path: Path, overrides: list[str], model_name: str, fleet_name: str = "bench",
              direct_ingress: bool = False) -> str:
    """Ray, Serve (:func:`start_serve`) and the app over ``path`` (its fleet named ``fleet_name``); the base URL."""
    from ray import serve

    from deploy.serve_app import app_builder

    port = start_serve(direct_ingress)
    app = app_builder({"model": str(path), "overrides": overrides, "model_name": model_name,
                       "fleet": {"name": fleet_name}})
    serve.run(app, name="graphfleet", route_prefix="/", blocking=False)
    return f"http://127.0.0.1:{port}"
