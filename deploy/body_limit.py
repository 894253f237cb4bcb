"""The request body's size limit, enforced before the body is read: ``serve.max_request_bytes``.

A request whose ``Content-Length`` is over the limit is answered 413 at once, its body unread; one
sent without a length (chunked) is counted as it arrives and answered 413 once it passes the limit.
Either way no byte of it is parsed, and the answer names the limit.
"""

from __future__ import annotations

from deploy.errors import ApiError

__all__ = ["BodyLimit", "too_large"]


def too_large(limit: int, size: int | None) -> ApiError:
    """The 413 of a body of ``size`` bytes (None: not known yet, only that it passed the limit)."""
    got = f"{size} bytes" if size is not None else "more"
    return ApiError(413, f"the request body is {got}; at most {limit} bytes are accepted (serve.max_request_bytes)",
                    code="request_too_large")


class BodyLimit:
    """ASGI middleware: ``app.add_middleware(BodyLimit, limit=...)``."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:  # the HTTP server holds the body to it
            if length.isdigit() and int(length) > self.limit:
                await too_large(self.limit, int(length)).response()(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No length (chunked): read the body here, up to the limit, then hand it on.
        buffered, seen = [], 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await too_large(self.limit, None).response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay():
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)
