"""The documented example bodies type-check against TypeScript types generated from the spec.

``openapi-typescript`` (default options) turns the live spec into ``kvplane.ts``; ``tsc --strict``
then compiles every example body of ``docs/integrators.md`` (a ```json block right after a
``<!-- example: SchemaName -->`` line) as a value of that schema, every ```ts block of the same
page, and the response accesses below (always-present response fields must not be optional). The
tools are pinned in ``tests/contract/node/package.json`` and installed there with ``npm ci`` (by
``make node-tools``, or by this test when ``node_modules`` is missing). Without node/npm, or
without the registry, the test is skipped loudly, and fails under ``CI=true``.

The examples are also checked against the server's own models (no Node needed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api import schemas
from api.app import create_app
from api.settings import Settings

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
DOCS = ROOT / "docs" / "integrators.md"
NODE_DIR = HERE / "node"
BIN = NODE_DIR / "node_modules" / ".bin"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

EXAMPLE = re.compile(r"<!-- example: (\w+) -->\s*```json\n(.*?)```", re.S)
TS_BLOCK = re.compile(r"```ts\n(.*?)```", re.S)

# Response fields that are always sent must be plain (not optional) in the generated types.
RESPONSES_TS = """\
import type { components } from "./kvplane";
type S = components["schemas"];

export function responses(
  t: S["TransferRead"], p: S["PlanRead"], i: S["InstanceRead"], w: S["WorkerRead"],
): [string, boolean, number, number, string | null, number, boolean, string | null] {
  const mode: "auto" | "staged" | "fragments" = t.mode;
  const route = p.routes[0];
  const receiver = p.receivers[0];
  return [
    mode, t.verify, t.attempt + p.bytes_per_block + p.runs + route.cp_modulus,
    route.slices.length + route.segments[0].layer_group + receiver.writer_ranks.length
      + receiver.staging[0].offset_per_block + t.routes[0].blocks + t.routes[0].runs,
    route.cp_side, i.tp + i.ranks[0].pools.length, i.attention_dp, w.directory_revision,
  ];
}

// what a client reads it can send back
export function putBack(read: S["InstanceRead"]): S["InstanceCreate"] {
  return read;
}
"""

# tsc must reject these (proof that the check can fail).
WRONG_TS = """\
import type { components } from "./kvplane";
type S = components["schemas"];
export const wrongMode: S["TransferCreate"] = {
  context: "a", generation: "b", request_id: "r", mode: "bogus",
  blocks: { "0": { context: [1], generation: [1] } },
};
export const wrongBlocks: S["TransferCreate"] = {
  context: "a", generation: "b", request_id: "r", blocks: { "0": { context: ["1"] } },
};
"""


def examples() -> list[tuple[str, str]]:
    found = [(name, body) for name, body in EXAMPLE.findall(DOCS.read_text())]
    assert found, f"no `<!-- example: Schema -->` json blocks in {DOCS}"
    return found


def test_documented_examples_are_accepted_by_the_server(tmp_path: Path) -> None:
    names = {name for name, _ in examples()}
    assert {"InstanceCreate", "PairingCreate", "TransferCreate"} <= names
    app = create_app(
        Settings(database_url=f"sqlite:///{tmp_path / 'docs.db'}", migrate_on_startup=True)
    )
    with TestClient(app) as client:
        for number, (name, body) in enumerate(examples()):
            model = getattr(schemas, name)
            model.model_validate_json(body)  # strict, unknown fields refused
            if name == "InstanceCreate":  # and the page-table rules hold
                response = client.put(
                    f"/v1/instances/docs-example-{number}",
                    content=body,
                    headers={"Content-Type": "application/json"},
                )
                assert response.status_code == 201, response.text


def _node_tools() -> tuple[Path, Path]:
    def unavailable(reason: str) -> None:
        if IN_CI:
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(f"TYPESCRIPT CHECK SKIPPED: {reason}")

    generator, tsc = BIN / "openapi-typescript", BIN / "tsc"
    if not (generator.exists() and tsc.exists()):
        npm = shutil.which("npm")
        if shutil.which("node") is None or npm is None:
            unavailable("node/npm are not installed (CI installs them: .ci/run)")
        assert npm is not None
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--prefix", str(NODE_DIR)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0 or not generator.exists():
            unavailable(f"npm ci in {NODE_DIR} failed: {done.stderr.strip()[-500:]}")
    return generator, tsc


def _tsc(tsc: Path, cwd: Path, files: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(tsc),
            "--strict",
            "--noEmit",
            "--target",
            "es2022",
            "--module",
            "es2022",
            "--moduleResolution",
            "bundler",
            "--skipLibCheck",
            *files,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_documented_bodies_type_check_with_generated_typescript(tmp_path: Path) -> None:
    generator, tsc = _node_tools()
    spec = tmp_path / "openapi.json"
    spec.write_text(json.dumps(create_app(Settings(database_url="sqlite://")).openapi()))
    done = subprocess.run(
        [str(generator), str(spec), "--output", str(tmp_path / "kvplane.ts")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    lines = ['import type { components } from "./kvplane";', 'type S = components["schemas"];']
    for index, (name, body) in enumerate(examples()):
        lines.append(f'export const example{index}: S["{name}"] = {body.strip()};')
    (tmp_path / "examples.ts").write_text("\n".join(lines) + "\n")
    files = ["examples.ts", "responses.ts"]
    (tmp_path / "responses.ts").write_text(RESPONSES_TS)
    blocks = TS_BLOCK.findall(DOCS.read_text())
    assert blocks, f"no ```ts block in {DOCS}"
    for index, block in enumerate(blocks):
        (tmp_path / f"doc{index}.ts").write_text(block)
        files.append(f"doc{index}.ts")

    checked = _tsc(tsc, tmp_path, files)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    (tmp_path / "wrong.ts").write_text(WRONG_TS)
    wrong = _tsc(tsc, tmp_path, ["wrong.ts"])
    assert wrong.returncode != 0
    assert "wrong.ts(4," in wrong.stdout and "wrong.ts(8," in wrong.stdout, wrong.stdout
