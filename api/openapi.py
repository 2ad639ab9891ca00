"""Final touches on the generated OpenAPI spec, for clients generated from it.

- **Request defaults live in descriptions.** A field that a request may omit carries no JSON
  Schema ``default`` in the schemas that request bodies use; its description says
  ``Default: …`` instead. Code generators read ``default`` as "always present" (openapi-typescript
  makes such fields required unless run with ``--default-non-nullable false``), which is right for
  responses and wrong for requests. Response schemas keep their defaults and list every
  always-present field as ``required`` (see :mod:`api.schemas`), so they do not depend on it.
  Schemas used by both (the page-table models that instance reads echo back) are request schemas
  here: what a client reads it can send back.

Security requirements depend on the server's auth setting and are declared by
:func:`api.auth.document`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI

SCHEMA_REF_PREFIX = "#/components/schemas/"


def _refs(node: Any) -> Iterator[str]:
    """Names of the component schemas that ``node`` references directly."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(SCHEMA_REF_PREFIX):
            yield ref.removeprefix(SCHEMA_REF_PREFIX)
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def request_schemas(spec: dict[str, Any]) -> set[str]:
    """Every component schema that some request body uses, directly or nested."""
    schemas = spec.get("components", {}).get("schemas", {})
    pending = [
        name
        for item in spec.get("paths", {}).values()
        for operation in item.values()
        if isinstance(operation, dict)
        for name in _refs(operation.get("requestBody", {}))
    ]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in schemas:
            continue
        seen.add(name)
        pending.extend(_refs(schemas[name]))
    return seen


def move_request_defaults(spec: dict[str, Any]) -> None:
    """Move ``default`` of request-body schema properties into their descriptions."""
    schemas = spec.get("components", {}).get("schemas", {})
    for name in sorted(request_schemas(spec)):
        for field in schemas[name].get("properties", {}).values():
            if "default" not in field:
                continue
            default = field.pop("default")
            if default is None or default == [] or default == {}:
                continue  # "absent" needs no words
            note = f"Default: `{json.dumps(default)}`."
            description = field.get("description", "").rstrip()
            if description and not description.endswith("."):
                description += "."
            field["description"] = f"{description} {note}".strip()


def add_stream_schemas(spec: dict[str, Any]) -> None:
    """The models of streamed lines (no route returns them as a body, so FastAPI does not add
    them): ``TransferCommand``, the ``transfer`` line of a worker's command stream."""
    from api.schemas_exec import TransferCommand

    schema = TransferCommand.model_json_schema(ref_template=SCHEMA_REF_PREFIX + "{model}")
    spec.setdefault("components", {}).setdefault("schemas", {})["TransferCommand"] = schema


def document(app: FastAPI) -> None:
    """Apply the touches above once, when the spec is first built."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        spec = build()
        move_request_defaults(spec)
        add_stream_schemas(spec)
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
