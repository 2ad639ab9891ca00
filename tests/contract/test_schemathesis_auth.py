"""Schemathesis over the whole spec with auth on: zero server errors.

Every generated case is sent three times: with an admin token (full conformance checks: auth must
not change what the spec promises), without a token and with a forged one (401 problem+json for
every route but the open health probes, never a 5xx). Bounded examples: well under three minutes.
"""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from api.auth import POLICY, create_token
from api.db import Database
from api.settings import Settings

MAX_EXAMPLES = 20
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def _operations() -> list[tuple[str, str]]:
    spec = create_app(Settings(database_url="sqlite://")).openapi()
    return [
        (f"{method.upper()} {path}", op["operationId"])
        for path, item in spec["paths"].items()
        for method, op in item.items()
    ]


@pytest.fixture
def secured(sqlite_url: str):  # type: ignore[no-untyped-def]
    db = Database(sqlite_url)
    with db.write() as session:
        _, admin = create_token(session=session, scope="admin")
    db.dispose()
    app = create_app(Settings(database_url=sqlite_url, demo_fleet=True, auth=True))
    with TestClient(app):  # run the lifespan once: registers the demo fleet
        pass
    return schemathesis.openapi.from_asgi("/openapi.json", app), admin


@pytest.mark.parametrize(("label", "operation_id"), _operations())
def test_api_with_auth_never_500(secured, label: str, operation_id: str) -> None:  # type: ignore[no-untyped-def]
    api_schema, admin = secured
    operation = next(
        result.ok() for result in api_schema.get_all_operations() if result.ok().label == label
    )
    is_open = POLICY[operation_id].open

    @given(case=operation.as_strategy())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def run(case) -> None:  # type: ignore[no-untyped-def]
        headers = {**(case.headers or {})}
        headers.pop("Authorization", None)
        calls.append(
            case.call_and_validate(
                headers={**headers, "Authorization": f"Bearer {admin}"}, checks=CHECKS
            ).status_code
        )
        for auth in (None, "Bearer kvp_forged"):
            response = case.call(headers={**headers, **({"Authorization": auth} if auth else {})})
            assert response.status_code < 500
            if not is_open:
                assert response.status_code == 401, (label, response.text)
                content_type = response.headers.get("content-type")
                assert "application/problem+json" in str(content_type), content_type

    calls: list[int] = []
    run()
    assert calls, f"schemathesis generated no request for {label}"
    assert max(calls) < 500
