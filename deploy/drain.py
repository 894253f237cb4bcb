"""The HTTP side of a replica's drain: an ASGI gate that refuses new API requests once the drain has
begun and counts the responses still open, so the drain knows when the last stream has been sent.

:meth:`deploy.serve_app.OpenAIIngress.drain` closes the gate, drains the fleet
(:meth:`fleet.fleet.Fleet.drain`) and waits for :attr:`Admission.open` to reach 0.
"""

from __future__ import annotations

import asyncio
import time

from deploy.errors import ApiError

__all__ = ["DRAIN_RETRY_AFTER_S", "Admission", "DrainGate"]

#: Seconds a client refused by a draining replica is told to wait (another replica may take it).
DRAIN_RETRY_AFTER_S = 1

#: Paths answered while draining (liveness probes, load balancers and scrapers must see the drain; no
#: work is queued).
_OPEN_PATHS = ("/live", "/health", "/metrics")


class Admission:
    """Whether the replica admits API requests, and how many it is still answering.

    ``open`` counts the API requests (every path but ``/live``, ``/health`` and ``/metrics``) from their first
    byte until their response's last, streamed or not. Only the replica's event loop touches it.
    """

    def __init__(self) -> None:
        self.draining = False
        self.open = 0

    def close(self) -> None:
        """Refuse every API request from now on (503, ``Retry-After``, code ``draining``)."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no API request is open (True) or ``timeout_s`` has passed (False)."""
        end = time.monotonic() + timeout_s
        while self.open > 0:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.02)
        return True


def _route_path(scope: dict) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class DrainGate:
    """ASGI middleware over the API app (``app.add_middleware(DrainGate, admission=...)``): counts open
    API requests in ``admission`` and, once it is closed, answers each new one with 503 and an
    OpenAI error body saying the server is draining."""

    def __init__(self, app, admission: Admission) -> None:
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.admission.draining:
            refused = ApiError(503, "the server is draining (shutting down): it accepts no new requests; retry "
                                    "on another replica", "service_unavailable", code="draining",
                               headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})
            await refused.response()(scope, receive, send)
            return
        self.admission.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.open -= 1
