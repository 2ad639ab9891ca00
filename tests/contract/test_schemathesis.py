"""Property-based run over the whole spec: no 5xx, and every response conforms to the spec.

Runs in-process against the ASGI app on a fresh migrated SQLite database seeded with the demo
fleet (so reads of existing resources are exercised too). ``max_examples`` is bounded so the whole
run stays well under three minutes.
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
from api.settings import Settings

MAX_EXAMPLES = 30
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def _operation_labels() -> list[str]:
    # The spec does not depend on the database: an unmigrated in-memory app is enough to list it.
    spec = create_app(Settings(database_url="sqlite://")).openapi()
    return [f"{method.upper()} {path}" for path, item in spec["paths"].items() for method in item]


@pytest.fixture
def api_schema(sqlite_url: str):  # type: ignore[no-untyped-def]
    app = create_app(Settings(database_url=sqlite_url, demo_fleet=True))
    with TestClient(app):  # run the lifespan once: registers the demo fleet
        pass
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize("label", _operation_labels())
def test_api_conforms_to_its_spec(api_schema, label: str) -> None:  # type: ignore[no-untyped-def]
    operation = next(
        result.ok() for result in api_schema.get_all_operations() if result.ok().label == label
    )

    @given(case=operation.as_strategy())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def run(case) -> None:  # type: ignore[no-untyped-def]
        calls.append(case.call_and_validate(checks=CHECKS).status_code)

    calls: list[int] = []
    run()
    assert calls, f"schemathesis generated no request for {label}"
    assert max(calls) < 500
