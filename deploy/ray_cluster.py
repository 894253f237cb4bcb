"""The Ray that ``graphfleet serve`` runs on, and how Serve listens there.

A given address (``--ray-address`` or ``RAY_ADDRESS``) is checked for a listening GCS in seconds
before ``ray.init`` (which would retry for minutes), then joined; without one, a local Ray of our
own is started, never the last cluster started on this machine. On a Ray we start, the API can be
served by its replica itself (Ray Serve's direct ingress, ``serve.direct_ingress``): the replica
binds the API's port once it runs, and Serve's proxy takes another loopback port.
"""

from __future__ import annotations

import os
import socket

#: Seconds a TCP connect to a given Ray address may take before ``serve`` gives up on it.
RAY_CONNECT_TIMEOUT_S = 5.0


def ray_address(given: str | None) -> str | None:
    """The Ray cluster to join: ``given`` (``--ray-address``), else ``RAY_ADDRESS``, else None (start our own)."""
    return given or os.environ.get("RAY_ADDRESS") or None


def gcs_host_port(address: str) -> tuple[str, int]:
    """The GCS (host, port) of a Ray address (``host:port``, ``ray://host:port``, ``auto``); SystemExit if
    it names none."""
    target = address
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        target = canonicalize_bootstrap_address("auto")
        if target is None:
            raise SystemExit("graphfleet: --ray-address auto: no running Ray cluster is recorded on this machine; "
                             "give its address, or none to start a local Ray")
    host, sep, port = target.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"graphfleet: Ray address {address!r} is not HOST:PORT (e.g. 10.0.0.5:6379)")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """SystemExit naming ``address`` unless its GCS accepts a TCP connection within ``timeout_s``
    (``ray.init`` would otherwise retry for minutes)."""
    host, port = gcs_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise SystemExit(f"graphfleet: cannot reach the Ray cluster at {address} (GCS {host}:{port}: "
                         f"{e.strerror or e}); start it (ray start --head), fix --ray-address/RAY_ADDRESS, or "
                         "give neither to start a local Ray") from None


def init_ray(address: str | None, host: str):
    """Join the Ray cluster at ``address`` (checked with :func:`check_reachable` first), or start our own
    (``address`` None): never the last cluster started on this machine, which a bare ``ray.init()`` joins."""
    import ray

    if address is not None:
        return join(address)
    return ray.init(address="local", _node_ip_address="127.0.0.1" if host in ("127.0.0.1", "localhost") else None,
                    include_dashboard=False)


def join(address: str, **init):
    """``ray.init`` on the cluster at ``address``; SystemExit naming it (and the likely cause) if that fails."""
    import ray

    try:
        return ray.init(address=address, include_dashboard=False, **init)
    except ConnectionError as e:
        raise SystemExit(f"graphfleet: cannot join the Ray cluster at {address}: {e} (its GCS answers TCP; a "
                         "cluster with token authentication also needs RAY_AUTH_MODE=token and its token, "
                         "RAY_AUTH_TOKEN or ~/.ray/auth_token)") from None


def direct_ingress_env(port: int) -> dict[str, str]:
    """The environment in which the Ray this process starts runs Serve's direct ingress with the API
    replica on ``port`` (Ray Serve reads it when its processes start; they inherit it).

    A direct-ingress replica that shuts down keeps answering for a minimum draining period (30 s by
    default: time for a load balancer in front to notice); here nothing is in front, and our own
    drain (serve.drain_timeout_s) has already run when Serve shuts the replica down: none.
    """
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def proxy_port(api_port: int) -> int:
    """A free loopback port for Serve's proxy other than ``api_port`` (free until its replica binds it,
    so the OS may offer it)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            if (found := s.getsockname()[1]) != api_port:
                return found
