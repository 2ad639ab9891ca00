"""The typed client: every route it calls exists, retries, problem+json → typed exceptions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from api import client as client_module
from api.app import create_app
from api.client import (
    CLIENT_ROUTES,
    AsyncClient,
    BadRequestError,
    Client,
    ConflictError,
    LeaseLostError,
    NotFoundError,
    TransportError,
    UnavailableError,
)
from api.settings import Settings

Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record backoff delays instead of sleeping them."""
    slept: list[float] = []

    async def _async_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(client_module.time, "sleep", slept.append)
    monkeypatch.setattr(client_module.asyncio, "sleep", _async_sleep)
    return slept


def _problem(status: int, code: str, detail: str, **extra: object) -> httpx.Response:
    return httpx.Response(
        status,
        headers={"Content-Type": "application/problem+json"},
        content=json.dumps(
            {
                "type": "about:blank",
                "title": "t",
                "status": status,
                "code": code,
                "detail": detail,
                **extra,
            }
        ),
    )


def _sequence(*responses: httpx.Response | Exception) -> tuple[Handler, list[httpx.Request]]:
    seen: list[httpx.Request] = []
    queue = list(responses)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        item = queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    return handler, seen


def test_every_client_route_exists_in_the_openapi_spec(tmp_path: Path) -> None:
    spec = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}")).openapi()
    missing = [
        f"{method} {path}"
        for method, path in CLIENT_ROUTES
        if method.lower() not in spec["paths"].get(path, {})
    ]
    assert not missing, f"the client calls routes the API does not have: {missing}"
    # and the list covers every method the client defines
    assert len(set(CLIENT_ROUTES)) == len(CLIENT_ROUTES) >= 24


def test_503_with_retry_after_is_retried_then_succeeds(_no_sleep: list[float]) -> None:
    handler, seen = _sequence(
        httpx.Response(503, headers={"Retry-After": "2"}, json={"code": "database_busy"}),
        httpx.Response(200, json={"name": "ctx"}),
    )
    with Client("http://cp", transport=httpx.MockTransport(handler), backoff_s=0.1) as api:
        assert api.get_instance("ctx") == {"name": "ctx"}
    assert [r.url.path for r in seen] == ["/v1/instances/ctx"] * 2
    assert len(_no_sleep) == 1 and 2.0 <= _no_sleep[0] <= 2.1  # Retry-After honoured


def test_async_client_retries_503_too(_no_sleep: list[float]) -> None:
    handler, seen = _sequence(
        httpx.Response(503, headers={"Retry-After": "1"}),
        httpx.Response(503, headers={"Retry-After": "1"}),
        httpx.Response(200, json={"items": []}),
    )

    async def main() -> object:
        async with AsyncClient("http://cp", transport=httpx.MockTransport(handler)) as api:
            return await api.list_workers()

    assert asyncio.run(main()) == {"items": []}
    assert len(seen) == 3 and len(_no_sleep) == 2


def test_503_after_all_retries_raises_unavailable() -> None:
    handler, seen = _sequence(*[_problem(503, "database_busy", "busy")] * 3)
    with (
        Client("http://cp", transport=httpx.MockTransport(handler), retries=2) as api,
        pytest.raises(UnavailableError) as caught,
    ):
        api.list_instances()
    assert len(seen) == 3 and caught.value.code == "database_busy"


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (404, "instance_not_found", NotFoundError),
        (409, "pairing_incompatible", ConflictError),
        (409, "lease_lost", LeaseLostError),
        (422, "validation_error", BadRequestError),
        (400, "invalid_blocks", BadRequestError),
    ],
)
def test_problem_json_maps_to_a_typed_exception(
    status: int, code: str, expected: type[Exception]
) -> None:
    errors = [{"loc": ["body", "tp"], "msg": "must be ≥ 1", "code": "too_small"}]
    handler, seen = _sequence(_problem(status, code, "what went wrong", errors=errors))
    with (
        Client("http://cp", transport=httpx.MockTransport(handler)) as api,
        pytest.raises(expected) as caught,
    ):
        api.create_pairing("ctx", "gen")
    error = caught.value
    assert type(error) is expected  # the most specific class
    assert (error.status, error.code, error.detail) == (status, code, "what went wrong")
    assert error.errors == errors
    assert len(seen) == 1  # client errors are final, never retried


def test_connection_errors_are_retried_then_raise_transport_error(
    _no_sleep: list[float],
) -> None:
    refused = httpx.ConnectError("connection refused")
    handler, seen = _sequence(refused, refused, refused, refused)
    with (
        Client("http://cp", transport=httpx.MockTransport(handler), retries=3) as api,
        pytest.raises(TransportError) as caught,
    ):
        api.heartbeat("w1")
    assert len(seen) == 4 and len(_no_sleep) == 3
    assert caught.value.code == "unreachable" and "refused" in caught.value.detail


def test_a_connection_error_then_success_recovers() -> None:
    handler, seen = _sequence(httpx.ConnectError("reset"), httpx.Response(204))
    with Client("http://cp", transport=httpx.MockTransport(handler)) as api:
        assert api.stop_worker("w1") is None  # 204: no body
    assert len(seen) == 2


def _by_host(**hosts: list[httpx.Response | Exception]) -> tuple[Handler, list[str]]:
    """A transport answering per host from its own queue; ``seen`` lists the hosts asked."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        item = hosts[request.url.host].pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    return handler, seen


def test_several_urls_fail_over_at_once_and_stay_on_the_one_that_answers(
    _no_sleep: list[float],
) -> None:
    handler, seen = _by_host(
        a=[httpx.ConnectError("refused")],
        b=[httpx.Response(200, json={"n": 1}), httpx.Response(200, json={"n": 2})],
    )
    with Client("http://a:8000, http://b:8000", transport=httpx.MockTransport(handler)) as api:
        assert api.urls == ["http://a:8000", "http://b:8000"]
        assert api.get_instance("ctx") == {"n": 1}
        assert api.url == "http://b:8000"
        assert api.get_instance("ctx") == {"n": 2}  # no going back to the dead one
    assert seen == ["a", "b", "b"]
    assert _no_sleep == [0.0]  # the first failover waits for nothing


def test_a_503_fails_over_and_every_url_gets_a_try_whatever_retries_says() -> None:
    handler, seen = _by_host(
        a=[_problem(503, "not_ready", "starting")], b=[httpx.Response(200, json={"items": []})]
    )
    with Client(["http://a", "http://b"], transport=httpx.MockTransport(handler), retries=0) as api:
        assert api.list_workers() == {"items": []}
    assert seen == ["a", "b"]


def test_both_urls_down_backs_off_then_raises(_no_sleep: list[float]) -> None:
    refused = httpx.ConnectError("refused")
    handler, seen = _by_host(a=[refused] * 3, b=[refused] * 3)
    with (
        Client("http://a,http://b", transport=httpx.MockTransport(handler), retries=3) as api,
        pytest.raises(TransportError),
    ):
        api.heartbeat("w1")
    assert seen == ["a", "b", "a", "b"]
    assert _no_sleep[0] == 0.0 and all(d >= 0 for d in _no_sleep[1:]) and len(_no_sleep) == 3


def test_create_transfer_always_carries_an_idempotency_key_and_retries_reuse_it() -> None:
    handler, seen = _sequence(
        httpx.ReadError("the API process died mid-request"),
        httpx.Response(200, json={"id": "t1"}),
        httpx.Response(201, json={"id": "t2"}),
    )
    with Client("http://a,http://b", transport=httpx.MockTransport(handler)) as api:
        assert api.create_transfer({"request_id": "r1"}) == {"id": "t1"}
        assert api.create_transfer({"request_id": "r2"}, idempotency_key="mine") == {"id": "t2"}
    keys = [r.headers.get("Idempotency-Key") for r in seen]
    assert keys[0] and keys[0] == keys[1]  # the retry through b is the same request
    assert [r.url.host for r in seen] == ["a", "b", "b"]
    assert keys[2] == "mine"


def test_a_dropped_command_stream_moves_the_client_to_the_next_url() -> None:
    handler, seen = _by_host(
        a=[httpx.RemoteProtocolError("peer closed connection")],
        b=[httpx.Response(200, content=b'{"type":"hello"}\n')],
    )
    with Client("http://a,http://b", transport=httpx.MockTransport(handler)) as api:
        with pytest.raises(TransportError):
            list(api.stream_commands("w1"))
        assert api.url == "http://b"
        assert list(api.stream_commands("w1")) == [{"type": "hello"}]
    assert seen == ["a", "b"]


def test_record_batches_are_encoded_in_slices_and_arrive_whole(_no_sleep: list[float]) -> None:
    """``Client.record_transfers`` encodes record by record, pausing (a GIL release that lets
    the rank's progress thread run) after every ENCODE_SLICE records, and the control plane
    gets the same JSON value that one ``json.dumps`` of the batch would have given."""
    records = [
        {
            "request_id": f"r-{i}",
            "rank": i % 4,
            "bytes": 1 << 20,
            "error": None,
            "note": 'quote " and ünïcode',
            "routes": [{"sender_rank": 0, "bytes": 7}],
        }
        for i in range(2 * client_module.ENCODE_SLICE + 5)
    ]
    handler, seen = _sequence(httpx.Response(200, json={"accepted": len(records), "settled": []}))
    client = Client("http://cp", transport=httpx.MockTransport(handler))
    assert client.record_transfers('w-"1', records) == {"accepted": len(records), "settled": []}
    (request,) = seen
    assert request.url.path == "/v1/transfers/records"
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.content) == {"worker_id": 'w-"1', "records": records}
    assert _no_sleep == [client_module.ENCODE_PAUSE_S] * 2  # after slices 1 and 2, not the end
    _no_sleep.clear()
    assert json.loads(client_module.encode_records("w", [])) == {"worker_id": "w", "records": []}
    assert _no_sleep == []
