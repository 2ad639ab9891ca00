"""Typed HTTP client of the kvplane API (sync and async), used by the workers and the CLI.

- Retries: 429 and 503 (honouring ``Retry-After``), 502/504 and connection errors are retried with
  exponential backoff and full jitter, up to ``retries`` times; other answers are final.
  Retried calls are safe: every retried route is idempotent (a record batch whose first attempt
  landed is ignored the second time, never counted twice).
- Several control-plane URLs (a list, or one comma-separated string such as ``KVPLANE_URL=
  http://cp-a:8000,http://cp-b:8000``): the client uses one until a connection error, a 502/503/504
  or a dropped command stream, then fails over to the next one, at once the first time in a call
  and with the usual backoff after that. It stays on the URL that answers (no flapping back).
- Creating a transfer always carries an ``Idempotency-Key`` (one is generated when the caller
  gives none): a retry that reaches another API process returns the same transfer, never a
  second one. The key is stored with the transfer in the database, so every process honours it.
- Errors: problem+json answers become :class:`ApiError` subclasses carrying ``status``, the stable
  ``code``, ``detail`` and the field ``errors``.

Depends on httpx and the wire models (pydantic) only, no FastAPI, no SQLAlchemy: workers import
it, and it is all they import of ``api``. The models a worker reads from the control plane are
re-exported here (:class:`TransferCommand`, a ``transfer`` line of its stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from api.schemas_exec import TransferCommand as TransferCommand  # re-exported for workers

log = logging.getLogger("kvplane.client")

DEFAULT_TIMEOUT_S = 30.0
RETRY_STATUSES = (429, 502, 503, 504)
FAIL_OVER_STATUSES = (502, 503, 504)  # the process may be gone (429: it is there, and busy)
ENCODE_SLICE = 64  # records per json.dumps slice of a record batch (~0.5-1.5 ms of work)
ENCODE_PAUSE_S = 0.0002  # the pause between slices


class ApiError(Exception):
    """A problem+json answer (or a non-JSON error) from the control plane."""

    def __init__(
        self, status: int, code: str, detail: str, errors: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.errors = errors or []


class BadRequestError(ApiError):
    """400/422: the request was refused; ``errors`` names the fields."""


class NotFoundError(ApiError):
    """404: the named resource does not exist."""


class ConflictError(ApiError):
    """409: the resource's state forbids it (incompatible, stale, retired, …)."""


class LeaseLostError(ConflictError):
    """409 ``lease_lost``: the job's lease is gone; drop the job, do not report it again."""


class PreconditionFailedError(ApiError):
    """412: ``If-Match`` did not hold."""


class UnavailableError(ApiError):
    """503 after all retries: the server or its database stayed busy."""


class TransportError(ApiError):
    """The control plane could not be reached (after all retries)."""


def _error_for(response: httpx.Response) -> ApiError:
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    code = str(body.get("code") or f"http_{status}")
    detail = str(body.get("detail") or body.get("title") or response.reason_phrase)
    errors = body.get("errors") if isinstance(body.get("errors"), list) else None
    if status == 409 and code == "lease_lost":
        return LeaseLostError(status, code, detail, errors)
    return _ERROR_TYPES.get(status, ApiError)(status, code, detail, errors)


_ERROR_TYPES: dict[int, type[ApiError]] = {
    400: BadRequestError,
    404: NotFoundError,
    409: ConflictError,
    412: PreconditionFailedError,
    422: BadRequestError,
    503: UnavailableError,
}


def _retry_delay(
    attempt: int, response: httpx.Response | None, base_s: float, cap_s: float
) -> float:
    if response is not None:
        header = response.headers.get("Retry-After")
        if header is not None:
            try:
                return min(cap_s, max(0.0, float(header))) + random.uniform(0, base_s)
            except ValueError:
                pass
    return random.uniform(0, min(cap_s, base_s * (2**attempt)))


class _Calls:
    """The API surface, written once; subclasses provide ``_request``."""

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:  # pragma: no cover
        raise NotImplementedError

    # instances -------------------------------------------------------------------------
    def register_instance(
        self, name: str, body: Mapping[str, Any], if_match: int | None = None
    ) -> Any:
        headers = {} if if_match is None else {"If-Match": str(if_match)}
        return self._request("PUT", f"/v1/instances/{name}", json=body, headers=headers)

    def report_rank(self, name: str, rank: int, body: Mapping[str, Any]) -> Any:
        return self._request("PUT", f"/v1/instances/{name}/ranks/{rank}", json=body)

    def get_instance(self, name: str) -> Any:
        return self._request("GET", f"/v1/instances/{name}")

    def list_instances(self, **params: Any) -> Any:
        return self._request("GET", "/v1/instances", params=params)

    def delete_instance(self, name: str) -> Any:
        return self._request("DELETE", f"/v1/instances/{name}")

    def get_instance_handovers(self, name: str) -> Any:
        return self._request("GET", f"/v1/instances/{name}/handovers")

    # pairings ---------------------------------------------------------------------------
    def create_pairing(self, context: str, generation: str) -> Any:
        return self._request(
            "POST", "/v1/pairings", json={"context": context, "generation": generation}
        )

    def get_pairing(self, pairing_id: str) -> Any:
        return self._request("GET", f"/v1/pairings/{pairing_id}")

    def list_pairings(self, **params: Any) -> Any:
        return self._request("GET", "/v1/pairings", params=params)

    def validate_pairing(self, pairing_id: str) -> Any:
        return self._request("POST", f"/v1/pairings/{pairing_id}/validate")

    def get_plan(
        self,
        pairing_id: str,
        context_dp_rank: int | None = None,
        generation_dp_rank: int | None = None,
    ) -> Any:
        params = {
            k: v
            for k, v in (
                ("context_dp_rank", context_dp_rank),
                ("generation_dp_rank", generation_dp_rank),
            )
            if v is not None
        }
        return self._request("GET", f"/v1/pairings/{pairing_id}/plan", params=params)

    def check_compatibility(self, body: Mapping[str, Any]) -> Any:
        return self._request("POST", "/v1/compatibility", json=body)

    # transfers --------------------------------------------------------------------------
    def create_transfer(
        self, body: Mapping[str, Any], idempotency_key: str | None = None, wait_s: float = 0.0
    ) -> Any:
        """Plan (and with ``execute``, dispatch) a transfer. Without ``idempotency_key`` one is
        generated, so a retry after a lost answer (or through another API process) returns
        the transfer the first attempt created instead of a duplicate. ``wait_s`` (with
        ``execute``): the answer comes once the transfer settled (or after that long)."""
        key = idempotency_key or uuid.uuid4().hex
        return self._request(
            "POST",
            "/v1/transfers",
            json=body,
            headers={"Idempotency-Key": key},
            params={"wait": wait_s} if wait_s else None,
            timeout=DEFAULT_TIMEOUT_S + wait_s,
        )

    def get_transfer(self, transfer_id: str, wait_s: float = 0.0) -> Any:
        params = {"wait": wait_s} if wait_s else {}
        return self._request(
            "GET", f"/v1/transfers/{transfer_id}", params=params, timeout=DEFAULT_TIMEOUT_S + wait_s
        )

    def get_fragments(self, transfer_id: str, offset: int = 0, limit: int | None = None) -> Any:
        """One page of a transfer's fragments (``next_offset`` says where the next starts)."""
        params: dict[str, int] = {"offset": offset} if offset else {}
        if limit is not None:
            params["limit"] = limit
        return self._request("GET", f"/v1/transfers/{transfer_id}/fragments", params=params)

    def retry_transfer(self, transfer_id: str) -> Any:
        return self._request("POST", f"/v1/transfers/{transfer_id}/retry")

    def list_transfers(self, **params: Any) -> Any:
        return self._request("GET", "/v1/transfers", params=params)

    # workers ----------------------------------------------------------------------------
    def register_worker(self, body: Mapping[str, Any]) -> Any:
        return self._request("POST", "/v1/workers", json=body)

    def heartbeat(self, worker_id: str, *, ucx_in_use: Mapping[str, Any] | None = None) -> Any:
        """Answers the worker with its ``directory_revision`` (409 when it must re-attach);
        ``ucx_in_use``: what UCX uses for its peer connections (no body without it)."""
        if ucx_in_use is None:
            return self._request("POST", f"/v1/workers/{worker_id}/heartbeat")
        return self._request(
            "POST", f"/v1/workers/{worker_id}/heartbeat", json={"ucx_in_use": ucx_in_use}
        )

    def get_directory(self, worker_id: str) -> Any:
        return self._request("GET", f"/v1/workers/{worker_id}/directory")

    def stop_worker(self, worker_id: str) -> Any:
        return self._request("DELETE", f"/v1/workers/{worker_id}")

    def list_workers(self, **params: Any) -> Any:
        return self._request("GET", "/v1/workers", params=params)

    def record_transfers(self, worker_id: str, records: Sequence[Mapping[str, Any]]) -> Any:
        return self._request(
            "POST", "/v1/transfers/records", json={"worker_id": worker_id, "records": records}
        )

    def list_parts(self, transfer_id: str) -> Any:
        return self._request("GET", f"/v1/transfers/{transfer_id}/parts")


#: Every (method, path template) the client calls; a test checks each exists in the spec.
CLIENT_ROUTES = (
    ("PUT", "/v1/instances/{name}"),
    ("PUT", "/v1/instances/{name}/ranks/{rank}"),
    ("GET", "/v1/instances/{name}"),
    ("GET", "/v1/instances"),
    ("DELETE", "/v1/instances/{name}"),
    ("GET", "/v1/instances/{name}/handovers"),
    ("POST", "/v1/pairings"),
    ("GET", "/v1/pairings/{pairing_id}"),
    ("GET", "/v1/pairings"),
    ("POST", "/v1/pairings/{pairing_id}/validate"),
    ("GET", "/v1/pairings/{pairing_id}/plan"),
    ("POST", "/v1/compatibility"),
    ("POST", "/v1/transfers"),
    ("GET", "/v1/transfers/{transfer_id}"),
    ("GET", "/v1/transfers/{transfer_id}/fragments"),
    ("POST", "/v1/transfers/{transfer_id}/retry"),
    ("GET", "/v1/transfers"),
    ("POST", "/v1/workers"),
    ("POST", "/v1/workers/{worker_id}/heartbeat"),
    ("GET", "/v1/workers/{worker_id}/directory"),
    ("GET", "/v1/workers/{worker_id}/commands"),
    ("DELETE", "/v1/workers/{worker_id}"),
    ("GET", "/v1/workers"),
    ("POST", "/v1/transfers/records"),
    ("GET", "/v1/transfers/{transfer_id}/parts"),
)


def _decode(response: httpx.Response) -> Any:
    if response.status_code == 204 or not response.content:
        return None
    return response.json()


def base_urls(base_url: str | Sequence[str]) -> list[str]:
    """The control plane's URLs from a list or a comma-separated string (``KVPLANE_URL``)."""
    items = base_url.split(",") if isinstance(base_url, str) else list(base_url)
    urls = [item.strip().rstrip("/") for item in items if item.strip()]
    if not urls:
        raise ValueError(f"no control-plane URL in {base_url!r}")
    return urls


class _Endpoints:
    """The control plane's base URLs: the one in use, and failing over to the next one.

    Shared by every thread of a client (a worker's heartbeat, command stream and recorder):
    whichever notices first that a process is gone moves all of them.
    """

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._index = 0
        self._lock = threading.Lock()

    @property
    def index(self) -> int:
        return self._index

    def url(self, index: int, path: str) -> str:
        return self.urls[index] + path

    def fail_over(self, index: int, reason: object) -> bool:
        """Leave URL ``index`` for the next one (unless another thread already left it);
        False when there is no other URL."""
        if len(self.urls) < 2:
            return False
        with self._lock:
            if self._index == index:
                self._index = (index + 1) % len(self.urls)
                log.warning(
                    "control plane %s failed (%s); failing over to %s",
                    self.urls[index],
                    reason,
                    self.urls[self._index],
                )
        return True


class _Retry:
    """The retry policy shared by both clients: what to do after each attempt."""

    def __init__(self, retries: int, backoff_s: float, max_backoff_s: float) -> None:
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def delay_after(
        self, attempt: int, response: httpx.Response | None, error: Exception | None
    ) -> float:
        """Seconds to wait before the next attempt; raises when the outcome is final."""
        if error is not None:
            if attempt >= self.retries:
                raise TransportError(0, "unreachable", str(error)) from error
        elif response is not None and (
            response.status_code not in RETRY_STATUSES or attempt >= self.retries
        ):
            raise _error_for(response)
        return _retry_delay(attempt, response, self.backoff_s, self.max_backoff_s)

    def next_attempt(
        self,
        endpoints: _Endpoints,
        index: int,
        tried: set[int],
        attempt: int,
        response: httpx.Response | None,
        error: Exception | None,
    ) -> float:
        """After a failed attempt on URL ``index``: fail over when the outcome says the process
        may be gone, and return the delay before the next attempt (none before a URL this call
        has not tried yet: every URL gets one try whatever ``retries`` says); raises when the
        outcome is final."""
        if error is not None or (
            response is not None and response.status_code in FAIL_OVER_STATUSES
        ):
            reason = (
                error
                if error is not None
                else (f"HTTP {0 if response is None else response.status_code}")
            )
            if endpoints.fail_over(index, reason) and endpoints.index not in tried:
                return 0.0
        return self.delay_after(attempt, response, error)


_NETWORK_ERRORS = (httpx.TransportError, httpx.TimeoutException)


def _encoded_list(records: Sequence[Mapping[str, Any]]) -> str:
    """``[record, ...]`` as JSON, one record per ``json.dumps`` call; after every
    ``ENCODE_SLICE`` records the calling thread sleeps a moment so that the process's other
    threads get the GIL (a bare release is not enough: the releasing thread takes it straight
    back)."""
    parts = []
    for i, record in enumerate(records, start=1):
        parts.append(json.dumps(record, separators=(",", ":")))
        if i % ENCODE_SLICE == 0 and i < len(records):
            time.sleep(ENCODE_PAUSE_S)
    return "[" + ",".join(parts) + "]"


def encode_records(worker_id: str, records: Sequence[Mapping[str, Any]]) -> bytes:
    """The JSON body ``{"worker_id": ..., "records": [...]}``, encoded in slices."""
    return (
        '{"worker_id":' + json.dumps(worker_id) + ',"records":' + _encoded_list(records) + "}"
    ).encode()


class StreamUnsupported(Exception):
    """The control plane (or the client's transport) has no two-way worker stream: use the
    command stream and ``POST /v1/transfers/records`` instead."""


class WorkerStream:
    """A worker's two-way stream (``/v1/workers/{id}/stream``, a WebSocket): iterate it for the
    command lines, call :meth:`record` from another thread to send a batch of records and wait
    for its answer. Iteration raises :class:`ApiError` when the server closed it with a problem
    (404, 409, 401, 403) and :class:`TransportError` when the connection dropped."""

    def __init__(self, connection: Any, read_timeout_s: float) -> None:
        self._connection = connection
        self._read_timeout_s = read_timeout_s
        self._lock = threading.Lock()
        self._seq = 0
        self._answers: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

        try:
            while True:
                try:
                    data = self._connection.recv(timeout=self._read_timeout_s)
                except TimeoutError:
                    raise TransportError(
                        0, "unreachable", "the worker stream went silent"
                    ) from None
                except ConnectionClosedOK as closed:
                    raise _closed_error(closed) from None
                except ConnectionClosed as closed:
                    raise TransportError(
                        0, "unreachable", f"the worker stream dropped: {closed}"
                    ) from None
                for line in (data if isinstance(data, bytes) else data.encode()).splitlines():
                    if not line.strip():
                        continue
                    message = json.loads(line)
                    if message.get("type") == "recorded":
                        self._answered(message)
                    else:
                        yield message
        finally:
            self.close()

    def _answered(self, message: dict[str, Any]) -> None:
        with self._lock:
            waiting = self._answers.pop(message.get("seq"), None)  # type: ignore[arg-type]
        if waiting is not None:
            waiting[1].append(message)
            waiting[0].set()

    def record(self, worker_id: str, records: Sequence[Mapping[str, Any]], timeout_s: float) -> Any:
        """Send one batch of records and wait for its answer (``{"accepted", "settled"}``).
        Raises :class:`ApiError` for a refused batch and :class:`TransportError` when the
        stream is closed or the answer does not come within ``timeout_s`` (send it again: a
        repeated record is ignored)."""
        if self.closed.is_set():
            raise TransportError(0, "unreachable", "the worker stream is closed")
        with self._lock:
            self._seq += 1
            seq = self._seq
            waiting: tuple[threading.Event, list[dict[str, Any]]] = (threading.Event(), [])
            self._answers[seq] = waiting
        message = (
            '{"type":"records","seq":' + str(seq) + ',"records":' + _encoded_list(records) + "}"
        )
        try:
            self._connection.send(message.encode())
        except Exception as error:
            with self._lock:
                self._answers.pop(seq, None)
            raise TransportError(0, "unreachable", f"the worker stream dropped: {error}") from error
        if not waiting[0].wait(timeout_s) or not waiting[1]:
            with self._lock:
                self._answers.pop(seq, None)
            raise TransportError(0, "unreachable", "no answer to a record batch on the stream")
        answer = waiting[1][0]
        problem = answer.get("error")
        if isinstance(problem, dict):
            status = int(problem.get("status", 500))
            kind = _ERROR_TYPES.get(status, ApiError)
            raise kind(status, str(problem.get("code", "error")), str(problem.get("detail", "")))
        return answer

    def close(self) -> None:
        self.closed.set()
        with self._lock:
            pending, self._answers = self._answers, {}
        for event, _ in pending.values():  # their callers raise TransportError at once
            event.set()
        with contextlib.suppress(Exception):
            self._connection.close()


def _closed_error(closed: Any) -> ApiError:
    """The problem a server-side close names (code 4000 + status), else a plain end."""
    rcvd = getattr(closed, "rcvd", None)
    code = getattr(rcvd, "code", 1000)
    reason = getattr(rcvd, "reason", "") or ""
    if 4000 <= code < 5000:
        status = code - 4000
        kind = _ERROR_TYPES.get(status, ApiError)
        return kind(
            status, reason or "closed", f"the control plane closed the worker stream ({reason})"
        )
    return TransportError(0, "unreachable", "the control plane closed the worker stream")


class Client(_Calls):
    """Synchronous client; ``with Client(url) as c: c.get_instance("ctx")``.

    ``base_url``: one URL, several (a list, or comma-separated), failed over in turn.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        token: str | None = None,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._auth_headers = headers
        self._transport = transport
        self._endpoints = _Endpoints(base_urls(base_url))
        self._http = httpx.Client(
            base_url=self._endpoints.urls[0],
            headers=headers,
            timeout=timeout_s,
            transport=transport,
        )
        self._retry = _Retry(retries, backoff_s, max_backoff_s)

    @property
    def url(self) -> str:
        """The control-plane URL in use now."""
        return self._endpoints.urls[self._endpoints.index]

    @property
    def urls(self) -> list[str]:
        """Every control-plane URL this client fails over between."""
        return list(self._endpoints.urls)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        attempt = 0
        tried: set[int] = set()
        while True:
            index = self._endpoints.index
            tried.add(index)
            response, error = None, None
            try:
                response = self._http.request(method, self._endpoints.url(index, path), **kwargs)
            except _NETWORK_ERRORS as caught:
                error = caught
            if response is not None and response.status_code < 400:
                return _decode(response)
            time.sleep(
                self._retry.next_attempt(self._endpoints, index, tried, attempt, response, error)
            )
            attempt += 1

    def record_transfers(self, worker_id: str, records: Sequence[Mapping[str, Any]]) -> Any:
        """As for every client, but the body is encoded in slices (:func:`encode_records`):
        a worker posts a second's records at once, and ``json.dumps`` of the whole batch is one
        C call that keeps the rank's other threads (its progress thread) off the GIL until it
        returns: 24-28 us of CPU per record inside a busy rank here, 12-14 ms for 500."""
        return self._request(
            "POST",
            "/v1/transfers/records",
            content=encode_records(worker_id, records),
            headers={"Content-Type": "application/json"},
        )

    def stream_commands(self, worker_id: str, *, read_timeout_s: float = 30.0) -> Iterator[Any]:
        """The worker's command stream: yields each JSON line as it arrives (no retries: the
        caller reconnects, and with several URLs a stream that could not open or that dropped
        moves the client to the next one first). Raises :class:`ApiError` on an error answer."""
        timeout = httpx.Timeout(DEFAULT_TIMEOUT_S, read=read_timeout_s)
        index = self._endpoints.index
        try:
            with self._http.stream(
                "GET",
                self._endpoints.url(index, f"/v1/workers/{worker_id}/commands"),
                timeout=timeout,
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    if response.status_code in RETRY_STATUSES:
                        self._endpoints.fail_over(index, f"HTTP {response.status_code}")
                    raise _error_for(response)
                for line in response.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except _NETWORK_ERRORS as error:
            self._endpoints.fail_over(index, error)
            raise TransportError(0, "unreachable", str(error)) from error

    def open_stream(self, worker_id: str, *, read_timeout_s: float = 30.0) -> WorkerStream:
        """The worker's two-way stream on the URL in use (with several URLs, one that cannot be
        reached moves the client to the next). Raises :class:`StreamUnsupported` when the
        server has no such route or this client talks through a transport of its own."""
        if self._transport is not None:
            raise StreamUnsupported("a client on a custom transport")
        try:
            from websockets.exceptions import InvalidStatus
            from websockets.sync.client import connect
        except ImportError as error:  # pragma: no cover - a dependency of the worker extra
            raise StreamUnsupported("the websockets package is not installed") from error
        index = self._endpoints.index
        url = self._endpoints.url(index, f"/v1/workers/{worker_id}/stream")
        url = "ws" + url[len("http") :] if url.startswith("http") else url
        try:
            connection = connect(
                url,
                additional_headers=dict(self._auth_headers),
                open_timeout=DEFAULT_TIMEOUT_S,
                close_timeout=1.0,
                compression=None,
                max_size=None,
            )
        except InvalidStatus as error:
            status = error.response.status_code
            if status in RETRY_STATUSES:
                self._endpoints.fail_over(index, f"HTTP {status}")
                raise TransportError(status, "unavailable", str(error)) from error
            raise StreamUnsupported(f"the control plane answered {status}") from error
        except (OSError, TimeoutError, Exception) as error:
            self._endpoints.fail_over(index, error)
            raise TransportError(0, "unreachable", str(error)) from error
        return WorkerStream(connection, read_timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Calls):
    """Asynchronous client with the same methods (each returns an awaitable) and the same
    failover between several URLs."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        token: str | None = None,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._endpoints = _Endpoints(base_urls(base_url))
        self._http = httpx.AsyncClient(
            base_url=self._endpoints.urls[0],
            headers=headers,
            timeout=timeout_s,
            transport=transport,
        )
        self._retry = _Retry(retries, backoff_s, max_backoff_s)

    @property
    def url(self) -> str:
        """The control-plane URL in use now."""
        return self._endpoints.urls[self._endpoints.index]

    async def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        attempt = 0
        tried: set[int] = set()
        while True:
            index = self._endpoints.index
            tried.add(index)
            response, error = None, None
            try:
                response = await self._http.request(
                    method, self._endpoints.url(index, path), **kwargs
                )
            except _NETWORK_ERRORS as caught:
                error = caught
            if response is not None and response.status_code < 400:
                return _decode(response)
            await asyncio.sleep(
                self._retry.next_attempt(self._endpoints, index, tried, attempt, response, error)
            )
            attempt += 1

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._send(method, path, **kwargs)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
