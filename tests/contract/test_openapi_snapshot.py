"""The live OpenAPI spec equals the committed snapshot (clients are generated from it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import ADMIN, POLICY
from api.openapi import request_schemas
from api.schemas import LAYER_GROUP_KEY_PATTERN
from api.settings import Settings

SNAPSHOT = Path(__file__).parent / "openapi.json"
REGENERATE = "KVPLANE_UPDATE_SNAPSHOT=1 .venv/bin/pytest tests/contract"


def _live_spec(tmp_path: Path) -> str:
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'spec.db'}"))
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


def test_openapi_matches_snapshot(tmp_path: Path) -> None:
    live = _live_spec(tmp_path)
    if os.environ.get("KVPLANE_UPDATE_SNAPSHOT") == "1":
        SNAPSHOT.write_text(live)
    assert SNAPSHOT.exists(), f"no snapshot at {SNAPSHOT}; create it with: {REGENERATE}"
    assert json.loads(live) == json.loads(SNAPSHOT.read_text()), (
        f"the OpenAPI spec changed; review the diff and regenerate with: {REGENERATE}"
    )


def test_every_route_is_documented(tmp_path: Path) -> None:
    spec = json.loads(_live_spec(tmp_path))
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            where = f"{method.upper()} {path}"
            assert operation.get("operationId"), where
            assert len(operation.get("tags", [])) == 1, where
            assert operation.get("description") or operation.get("summary"), where
            if path.startswith("/v1/"):
                problems = [
                    status
                    for status, response in operation["responses"].items()
                    if "application/problem+json" in response.get("content", {})
                ]
                assert problems, f"{where} documents no problem+json response"


def _spec(tmp_path: Path, **settings: object) -> dict[str, Any]:
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'spec.db'}", **settings))
    return app.openapi()


def _operations(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [op for item in spec["paths"].values() for op in item.values()]


def test_security_follows_the_auth_setting(tmp_path: Path) -> None:
    """Auth off (the default): no operation requires a token, so a generated client works
    without one. Auth on: every protected operation requires the bearer scheme."""
    off = _spec(tmp_path)
    assert "bearer" in off["components"]["securitySchemes"]
    assert [op["operationId"] for op in _operations(off) if "security" in op] == []
    on = _spec(tmp_path, auth=True)
    for operation in _operations(on):
        rule = POLICY.get(operation["operationId"], ADMIN)
        expected = None if rule.open else [{"bearer": []}]
        assert operation.get("security") == expected, operation["operationId"]
        if not rule.open:  # the scopes and the 401/403 answers are documented either way
            assert operation["x-kvplane-scopes"] and {"401", "403"} <= set(operation["responses"])
    # apart from security, both specs are the same
    for operation in _operations(on):
        operation.pop("security", None)
    assert on == off


def test_request_fields_with_defaults_are_optional_and_responses_list_every_field(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path)
    schemas = spec["components"]["schemas"]
    inputs = request_schemas(spec)
    assert {"TransferCreate", "InstanceCreate", "RankCreate", "PoolCreate", "BlockLists"} <= inputs
    for name in inputs:
        for prop, field in schemas[name].get("properties", {}).items():
            assert "default" not in field, f"{name}.{prop}: request defaults go to descriptions"
    transfer = schemas["TransferCreate"]
    assert {"mode", "verify", "execute"}.isdisjoint(transfer["required"])
    assert 'Default: `"auto"`' in transfer["properties"]["mode"]["description"]
    # responses: every field is sent, so every field is required
    for name in (
        "TransferRead",
        "PlanRead",
        "Route",
        "Receiver",
        "RouteSummary",
        "InstanceRead",
        "WorkerRead",
        "PairingRead",
    ):
        schema = schemas[name]
        assert sorted(schema["required"]) == sorted(schema["properties"]), name
        assert "additionalProperties" not in schema, name


def test_blocks_is_a_typed_map_with_a_documented_key_pattern(tmp_path: Path) -> None:
    blocks = _spec(tmp_path)["components"]["schemas"]["TransferCreate"]["properties"]["blocks"]
    assert blocks["additionalProperties"] == {"$ref": "#/components/schemas/BlockLists"}
    assert "patternProperties" not in blocks
    assert blocks["propertyNames"] == {"pattern": LAYER_GROUP_KEY_PATTERN}
    assert LAYER_GROUP_KEY_PATTERN in blocks["description"]


@pytest.mark.parametrize("key", ["01", "x", "-1", "12345678", ""])
def test_the_blocks_key_pattern_is_still_enforced(tmp_path: Path, key: str) -> None:
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'keys.db'}"))
    body = {
        "context": "a",
        "generation": "b",
        "request_id": "r",
        "blocks": {key: {"context": [1], "generation": [1]}},
    }
    with TestClient(app) as client:
        answer = client.post("/v1/transfers", json=body)
    assert answer.status_code == 422, answer.text
    problem = answer.json()
    assert problem["code"] == "validation_error"
    assert ["body", "blocks", key, "[key]"] in [error["loc"] for error in problem["errors"]]


def test_instance_reads_reuse_the_write_models(tmp_path: Path) -> None:
    schemas = _spec(tmp_path)["components"]["schemas"]
    read, write = schemas["InstanceRead"]["properties"], schemas["InstanceCreate"]["properties"]
    assert read["ranks"]["items"] == {"$ref": "#/components/schemas/RankCreate"}
    assert read["role"] == write["role"] == {"$ref": "#/components/schemas/Role"}
    for field in set(write) - {"ranks", "role"}:
        assert _types(read[field]) == _types(write[field]), field


def _types(schema: dict[str, Any]) -> Any:
    if "anyOf" in schema:
        return sorted(branch["type"] for branch in schema["anyOf"])
    return schema.get("type")
