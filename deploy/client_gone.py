"""A request whose client has gone ends quietly, behind Serve's proxy as on a plain ASGI server.

When the proxy loses a client it cancels the replica's task, and the replica's ASGI ``receive`` then
raises Ray's ``TaskCancelledError`` instead of returning ``http.disconnect``. Starlette treats that as
an application error: each hung-up stream logged a traceback ("unhandled error") and each body cut
short ended as a 500 with one, thousands under a fault soak. :class:`ClientGone` turns the
cancellation back into ``http.disconnect``, so a streaming response stops as it does on
disconnect, and a body read raises Starlette's ``ClientDisconnect`` (the API answers it 499,
counted as ``graphfleet_api_rejected_total{reason="client_closed"}``). Should the cancellation
reach the request's task as ``asyncio.CancelledError`` instead (the API on Serve's own event loop,
``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``), it ends it quietly by itself; a body read counts it too.
"""

from __future__ import annotations

from ray.exceptions import TaskCancelledError

__all__ = ["ClientGone"]

_DISCONNECT = {"type": "http.disconnect"}


class ClientGone:
    """ASGI middleware: ``receive`` answers ``http.disconnect`` where Serve's cancellation would raise."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:
                return _DISCONNECT

        await self.app(scope, receive_or_disconnect, send)
