"""Request-shape limits as pure ASGI middleware, answered before the app parses anything: 413 for
an oversized body, 422 for an encoded slash in an API path, and the pace of directory reads."""

from __future__ import annotations

import asyncio
import json
import math
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import PROBLEM_MEDIA_TYPE, PROBLEM_TYPE_PREFIX, status_title


async def _send_problem(send: Send, problem: dict[str, object], *, close: bool = False) -> None:
    """Answer with ``problem`` as problem+json, before the app sees the request."""
    body = json.dumps(problem).encode()
    headers = [
        (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": problem["status"], "headers": headers})
    await send({"type": "http.response.body", "body": body})


class EncodedSlashMiddleware:
    """422 for an API path whose name or id holds an encoded ``/`` (``%2F``).

    The server decodes the path before routing, so ``/v1/instances/a%2Fb`` would otherwise be
    routed as ``/v1/instances/a/b`` (a bare 404), and ``/v1/transfers/x%2Fretry`` as the retry
    route of transfer ``x``. No name or id may contain ``/``, so such a path is always refused.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw: bytes = (scope.get("raw_path") or b"") if scope["type"] == "http" else b""
        if not raw.startswith(b"/v1/") or b"%2f" not in raw.lower():
            await self.app(scope, receive, send)
            return
        field = "name" if raw.startswith(b"/v1/instances/") else "id"
        message = f"the {field} in the path must not contain '/' (%2F)"
        await _send_problem(
            send,
            {
                "type": PROBLEM_TYPE_PREFIX + "validation_error",
                "title": status_title(422),
                "status": 422,
                "code": "validation_error",
                "detail": f"Invalid field(s): path.{field}",
                "errors": [
                    {"loc": ["path", field], "msg": message, "code": "string_pattern_mismatch"}
                ],
            },
        )


class BodyLimitMiddleware:
    """Reject bodies over ``max_body_bytes`` (by Content-Length, or while streaming) with 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def _reject(self, send: Send) -> None:
        limit = self.max_body_bytes
        problem: dict[str, object] = {
            "type": PROBLEM_TYPE_PREFIX + "payload_too_large",
            "title": status_title(413),
            "status": 413,
            "code": "payload_too_large",
            "detail": f"The request body exceeds {limit} bytes.",
            "errors": [{"loc": ["body"], "msg": f"at most {limit} bytes"}],
        }
        await _send_problem(send, problem, close=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_body_bytes:
                    await self._reject(send)
                    return
        # Read the whole (bounded) body up front, then replay it to the app.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def _receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, _receive, send)


class DirectoryThrottle:
    """Paces each worker's directory reads (``GET /v1/workers/{id}/directory``).

    A worker reads its directory when its revision changes, a few times a minute at most; a
    client that reads it in a tight loop would take the server's CPU from every other request.
    Each worker id gets ``per_s`` reads a second with bursts of ``burst`` (a generic cell rate
    algorithm); a read over the rate waits for its turn, asleep on the event loop (it costs
    nothing meanwhile), when that turn is at most ``max_wait_s`` away, and is otherwise answered
    429 ``rate_limited`` with ``Retry-After``. ``per_s`` 0 turns pacing off.
    """

    PREFIX = b"/v1/workers/"
    SUFFIX = b"/directory"
    MAX_KEYS = 10_000  # then the ids with no debt are forgotten

    def __init__(self, app: ASGIApp, per_s: float, burst: int, max_wait_s: float = 1.0) -> None:
        self.app = app
        self.interval = 1.0 / per_s if per_s > 0 else 0.0
        self.tolerance = self.interval * max(burst - 1, 0)
        self.max_wait_s = max_wait_s
        self._due: dict[bytes, float] = {}  # worker id: its theoretical arrival time

    def _wait(self, key: bytes) -> float:
        """Seconds this read must wait (booking its turn), or -1 when it may not wait."""
        now = time.monotonic()
        due = max(self._due.get(key, now), now)
        wait = due - self.tolerance - now
        if wait > self.max_wait_s:
            return -1.0
        if len(self._due) >= self.MAX_KEYS:
            self._due = {k: t for k, t in self._due.items() if t > now}
        self._due[key] = due + self.interval
        return max(wait, 0.0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: bytes = (scope.get("raw_path") or b"") if scope["type"] == "http" else b""
        if (
            not self.interval
            or scope.get("method") != "GET"
            or not path.startswith(self.PREFIX)
            or not path.endswith(self.SUFFIX)
        ):
            await self.app(scope, receive, send)
            return
        wait = self._wait(path[len(self.PREFIX) : -len(self.SUFFIX)])
        if wait < 0:
            retry = max(1, math.ceil(self.interval))
            body = json.dumps(
                {
                    "type": PROBLEM_TYPE_PREFIX + "rate_limited",
                    "title": status_title(429),
                    "status": 429,
                    "code": "rate_limited",
                    "detail": "This worker's directory is read too often: "
                    f"{1 / self.interval:g} reads a second; retry after {retry} s.",
                }
            ).encode()
            headers = [
                (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(retry).encode()),
            ]
            await send({"type": "http.response.start", "status": 429, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        if wait > 0:
            await asyncio.sleep(wait)
        await self.app(scope, receive, send)
