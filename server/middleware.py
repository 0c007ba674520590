"""Two pure-ASGI middlewares: a request body cap, and request counting by route and status.

Pure ASGI (not `BaseHTTPMiddleware`) so neither adds a task or a copy per request beyond what it
needs. The body cap runs before FastAPI parses anything: a `Content-Length` above the cap is
refused at once, and a body without one (chunked) is counted while it streams in and refused as
soon as it passes the cap, so a client cannot make the server buffer more than `max_bytes`.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics import ServerMetrics

_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
#: methods counted under their own name. A client may send any token as a method, and each new
#: label value is a new series kept for the life of the process (3,000 made-up methods made
#: 3,000 series; 8 KB names grew /metrics to 16.5 MB), so every other method counts as "other".
COUNTED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


async def _send_json(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """413 for request bodies above `max_bytes` (declared or streamed); 400 for a bad length."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _BODYLESS:
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
                break
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _send_json(send, 400, "invalid Content-Length header")
                return
            if length > self.max_bytes:
                await _send_json(
                    send,
                    413,
                    f"request body of {length} bytes exceeds the cap of {self.max_bytes} bytes",
                )
                return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await _send_json(
                    send, 413, f"request body exceeds the cap of {self.max_bytes} bytes"
                )
                return
            more = message.get("more_body", False)

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body, only a disconnect can come

        await self.app(scope, replay, send)


class RequestMetrics:
    """Counts every HTTP response by route template, method and status, each label bounded:
    a route of the app or "unmatched", a method of `COUNTED_METHODS` or "other", a status code.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            labels = [_route_label(scope), _method_label(scope), str(status[0])]
            self.metrics.requests.labels(*labels).inc()


def _route_label(scope: Scope) -> str:
    # The route template (not the raw path) keeps the label set small and free of user input.
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


def _method_label(scope: Scope) -> str:
    method = scope["method"]
    return method if method in COUNTED_METHODS else "other"
