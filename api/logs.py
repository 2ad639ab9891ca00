"""Logging: stdlib ``logging``, one line per record, JSON when ``KVPLANE_LOG_JSON=true``.

Every record carries the context ids known where it was emitted: ``request_id`` (set by
:class:`RequestIdMiddleware` from ``X-Request-ID`` or a new one, echoed on the response),
``transfer_id``, ``job_id`` and ``worker_id``. They come from context variables
(:func:`log_context`), from :func:`set_process_context` (a worker's id, also seen by its
heartbeat thread) or from ``extra={...}`` on the call, which wins.

Imports neither FastAPI nor SQLAlchemy: workers use it too.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTEXT_FIELDS = ("request_id", "transfer_id", "job_id", "worker_id")
REQUEST_ID_HEADER = "X-Request-ID"
# Echoed into logs and headers: printable ASCII without spaces, bounded.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")
_HANDLER_NAME = "kvplane"
#: Libraries that log every HTTP request at INFO: a worker's heartbeats and claims would drown
#: what happened. Our own access log (``kvplane.access``) already records the server's side.
QUIET_LOGGERS = ("httpx", "httpcore")

_context: ContextVar[Mapping[str, str] | None] = ContextVar("kvplane_log_context", default=None)
_process: dict[str, str] = {}

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}

access_log = logging.getLogger("kvplane.access")
#: Requests that every worker and probe repeats (a heartbeat each second per rank, command-stream
#: polls, health probes): their access lines go out at DEBUG while they succeed, so a served
#: fleet's log shows what changed, not that it is alive.
ROUTINE_PATHS = re.compile(r"^/(?:v1/workers/[^/]+/(?:heartbeat|commands)|healthz|readyz)$")


def current_context() -> dict[str, str]:
    """The context ids in effect here (process-wide ones, overridden by bound ones)."""
    return {**_process, **(_context.get() or {})}


@contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Bind context ids (``transfer_id=…``, ``job_id=…``) to every record logged inside."""
    bound = {key: str(value) for key, value in ids.items() if value is not None}
    token = _context.set({**(_context.get() or {}), **bound})
    try:
        yield
    finally:
        _context.reset(token)


def set_process_context(**ids: str | None) -> None:
    """Ids true for the whole process (a worker's id), seen by every thread."""
    for key, value in ids.items():
        if value is None:
            _process.pop(key, None)
        else:
            _process[key] = str(value)


class ContextFilter(logging.Filter):
    """Puts the context ids on each record (an explicit ``extra=`` value wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in current_context().items():
            if getattr(record, key, None) is None:
                setattr(record, key, value)
        return True


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, logger, message, context ids, extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_") and value is not None:
                entry[key] = _jsonable(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time level logger message [id=…]`` for people reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(
            f"{key}={getattr(record, key)}"
            for key in CONTEXT_FIELDS
            if getattr(record, key, None) is not None
        )
        return f"{line} [{ids}]" if ids else line


def configure_logging(*, json_lines: bool, level: int | str = logging.INFO) -> logging.Handler:
    """Install one stderr handler on the root logger (replacing a previous kvplane one)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    handler.addFilter(ContextFilter())
    root.addHandler(handler)
    root.setLevel(level)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return handler


def request_id_of(raw: str | None) -> str:
    """The client's request id when it is well-formed, else a new one."""
    if raw and _REQUEST_ID.match(raw):
        return raw
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Binds ``X-Request-ID`` (the client's, or a new one) to the request's logs and echoes it.

    Also writes one ``kvplane.access`` record per request (method, path, status, duration), so
    access lines carry the request id (uvicorn's own access log runs outside the request).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                raw = value.decode("latin-1")
                break
        request_id = request_id_of(raw)
        start = time.perf_counter()
        status = 500

        async def _send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        with log_context(request_id=request_id):
            try:
                await self.app(scope, receive, _send)
            finally:
                routine = status < 400 and ROUTINE_PATHS.match(scope["path"]) is not None
                access_log.log(
                    logging.DEBUG if routine else logging.INFO,
                    "%s %s %d %.1fms",
                    scope["method"],
                    scope["path"],
                    status,
                    (time.perf_counter() - start) * 1000,
                    extra={"method": scope["method"], "path": scope["path"], "status": status},
                )
