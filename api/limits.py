"""Request-body limit as pure ASGI middleware: 413 problem+json before the app parses anything."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import PROBLEM_MEDIA_TYPE, PROBLEM_TYPE_PREFIX


class BodyLimitMiddleware:
    """Reject bodies over ``max_body_bytes`` (by Content-Length, or while streaming) with 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def _reject(self, send: Send) -> None:
        body = json.dumps(
            {
                "type": PROBLEM_TYPE_PREFIX + "payload_too_large",
                "title": "Payload too large",
                "status": 413,
                "code": "payload_too_large",
                "detail": f"The request body exceeds {self.max_body_bytes} bytes.",
                "errors": [{"loc": ["body"], "msg": f"at most {self.max_body_bytes} bytes"}],
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

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
