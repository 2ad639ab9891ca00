"""The live OpenAPI spec equals the committed snapshot (clients are generated from it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from api.app import create_app
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
