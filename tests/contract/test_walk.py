"""Real responses of every route, walked against the spec: no key that the spec does not declare.

A scripted flow drives the app (real database, real services) through registration, pairing,
plans, transfers, workers and their records, and provokes the documented problems. Then a
generic sweep calls every operation of the spec that has not answered 2xx yet: path
parameters come from the ids seen so far (``name`` → instances, ``<thing>_id`` → the ids under
``/v1/<thing>s``), bodies are the last body sent to that operation or one built from its
request schema. New routes are thus walked without being listed here. Every recorded answer
must then:

- have a status and a content type that its operation documents;
- validate against the documented schema (types, ``required``);
- carry no key that the schema does not declare (``properties``; a map is walked through its
  ``additionalProperties`` schema; only an object schema without any ``properties`` is free-form).

Every operation must have answered 2xx at least once, so that its success schema was checked. An
operation that the sweep cannot drive to a 2xx (it needs a body or a state the sweep cannot guess)
fails the test by name: add a step for it to ``_flow``.

Problem answers also share one ``title`` per status.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.demo_fleet import fake_peer, instance_body, rank_body
from api.errors import STATUS_TITLES
from api.migrate import upgrade
from api.settings import Settings
from geometry import builders

JSON_TYPES = ("application/json", "application/problem+json")
INSTANCE_FIELDS = ("name", "instance", "context", "generation")
Spec = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# walking one value against one schema


def _resolve(spec: Spec, schema: Any) -> Any:
    while isinstance(schema, dict) and "$ref" in schema:
        node: Any = spec
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


_VALIDATORS: dict[tuple[int, str], Any] = {}


def _validator(spec: Spec, schema: Any) -> Any:
    key = (id(spec), json.dumps(schema, sort_keys=True))
    if key not in _VALIDATORS:
        root = {**schema, "components": spec["components"]} if isinstance(schema, dict) else schema
        _VALIDATORS[key] = jsonschema_rs.Draft202012Validator(root)
    return _VALIDATORS[key]


def _valid(spec: Spec, schema: Any, value: Any) -> bool:
    return bool(_validator(spec, schema).is_valid(value))


def undeclared(spec: Spec, schema: Any, value: Any, where: str = "$") -> list[str]:
    """Paths of the keys in ``value`` that ``schema`` does not declare."""
    schema = _resolve(spec, schema)
    if not isinstance(schema, dict):
        return []
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            fits = [branch for branch in schema[combinator] if _valid(spec, branch, value)]
            if not fits:
                return []  # a type mismatch: the validator reports it
            return min((undeclared(spec, branch, value, where) for branch in fits), key=len)
    if "allOf" in schema:
        merged: dict[str, Any] = {"properties": {}}
        for branch in schema["allOf"]:
            branch = _resolve(spec, branch)
            merged["properties"].update(branch.get("properties", {}))
        return undeclared(spec, merged, value, where)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        found: list[str] = []
        for key, item in value.items():
            if key in properties:
                found += undeclared(spec, properties[key], item, f"{where}.{key}")
            elif isinstance(extra, dict):
                found += undeclared(spec, extra, item, f"{where}[{key!r}]")
            elif properties or extra is False:
                found.append(f"{where}.{key}")
        return found
    if isinstance(value, list):
        prefix = schema.get("prefixItems", [])
        items = schema.get("items")
        found = []
        for index, item in enumerate(value):
            item_schema = prefix[index] if index < len(prefix) else items
            if item_schema is not None:
                found += undeclared(spec, item_schema, item, f"{where}[{index}]")
        return found
    return []


def test_the_walker_finds_undeclared_keys() -> None:
    spec: Spec = {
        "components": {
            "schemas": {
                "Leaf": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "Map": {
                    "type": "object",
                    "additionalProperties": {"$ref": "#/components/schemas/Leaf"},
                },
            }
        }
    }
    leaf = {"$ref": "#/components/schemas/Leaf"}
    nullable = {"anyOf": [leaf, {"type": "null"}]}
    assert undeclared(spec, leaf, {"a": 1}) == []
    assert undeclared(spec, leaf, {"a": 1, "b": 2}) == ["$.b"]
    assert undeclared(spec, {"type": "array", "items": nullable}, [None, {"b": 1}]) == ["$[1].b"]
    assert undeclared(spec, {"$ref": "#/components/schemas/Map"}, {"0": {"c": 1}}) == ["$['0'].c"]
    free = {"type": "object", "additionalProperties": True}
    assert undeclared(spec, free, {"anything": {"goes": 1}}) == []
    allowed = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    assert undeclared(spec, allowed, {"a": 1, "z": 2}) == ["$.z"]  # declared beats allowed


# ---------------------------------------------------------------------------------------------
# recording real exchanges


@dataclass
class Exchange:
    method: str
    path: str  # the spec's path template
    url: str
    status: int
    content_type: str
    body: Any
    sent: Any


@dataclass
class Walk:
    client: TestClient
    spec: Spec
    exchanges: list[Exchange] = field(default_factory=list)
    _patterns: list[tuple[int, re.Pattern[str], str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for path in self.spec["paths"]:
            regex = "^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) + "$"
            self._patterns.append((path.count("{"), re.compile(regex), path))
        self._patterns.sort(key=lambda entry: entry[0])  # literal segments win over parameters

    def template(self, url: str) -> str | None:
        path = httpx.URL(url).path
        return next((tpl for _, regex, tpl in self._patterns if regex.match(path)), None)

    def call(
        self,
        method: str,
        url: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        expect: int | None = None,
    ) -> httpx.Response:
        template = self.template(url)
        assert template is not None, f"{method} {url} is no route of the spec"
        kwargs: dict[str, Any] = {"headers": headers or {}}
        if content is not None:
            kwargs["content"] = content
            kwargs["headers"] = {"Content-Type": "application/json", **kwargs["headers"]}
        elif json_body is not None:
            kwargs["json"] = json_body
        response = self.client.request(method, url, **kwargs)
        content_type = response.headers.get("content-type", "").split(";")[0].strip()
        body: Any = None
        if response.content and content_type in JSON_TYPES:
            body = response.json()
        self.exchanges.append(
            Exchange(
                method.lower(), template, url, response.status_code, content_type, body, json_body
            )
        )
        if expect is not None:
            assert response.status_code == expect, (
                f"{method} {url}: {response.status_code} {response.text[:500]}"
            )
        return response

    def json(self, method: str, url: str, **kwargs: Any) -> Any:
        return self.call(method, url, **kwargs).json()

    # -- generic sweep --------------------------------------------------------------------

    def operations(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        for path, item in self.spec["paths"].items():
            for method, operation in item.items():
                yield path, method, operation

    def succeeded(self, path: str, method: str) -> bool:
        return any(
            x.path == path and x.method == method and 200 <= x.status < 300 for x in self.exchanges
        )

    def ids(self, param: str) -> list[str]:
        """Values for a path parameter (or body field), most recent first, from what the server
        answered."""
        if param in INSTANCE_FIELDS:
            prefix, key = "/v1/instances", "name"
        elif param.endswith("_id"):
            prefix, key = f"/v1/{param.removesuffix('_id')}s", "id"
        elif param == "rank":
            return ["0"]
        else:
            return []
        seen: list[str] = []
        for exchange in reversed(self.exchanges):
            if not exchange.path.startswith(prefix) or exchange.status >= 300:
                continue
            for value in _values_of(exchange.body, key):
                if value not in seen:
                    seen.append(value)
        return seen

    def body_for(self, path: str, method: str, operation: dict[str, Any]) -> Any:
        sent = [x.sent for x in self.exchanges if x.path == path and x.method == method]
        sent = [body for body in sent if body is not None]
        if sent:
            return sent[-1]
        content = operation.get("requestBody", {}).get("content", {})
        schema = content.get("application/json", {}).get("schema")
        return None if schema is None else self.example(schema)

    def example(self, schema: Any) -> Any:
        """A small value of ``schema``: required properties only, ids from the server."""
        schema = _resolve(self.spec, schema)
        if "anyOf" in schema or "oneOf" in schema:
            branches = schema.get("anyOf") or schema.get("oneOf")
            return self.example(next(b for b in branches if b.get("type") != "null"))
        if "enum" in schema:
            return schema["enum"][0]
        kind = schema.get("type")
        if kind == "object":
            out: dict[str, Any] = {}
            for key in schema.get("required", []):
                prop = schema["properties"][key]
                known = self.ids(key)
                out[key] = known[0] if known else self.example(prop)
            return out
        if kind == "array":
            return [self.example(schema["items"])] * schema.get("minItems", 0)
        if kind == "integer":
            return int(schema.get("minimum", 0))
        if kind == "number":
            return float(schema.get("minimum", 0))
        if kind == "boolean":
            return False
        if kind == "string":
            return "x" * max(1, schema.get("minLength", 1))
        return None

    def sweep(self) -> None:
        """Call every JSON operation that has not answered 2xx yet, as well as we can guess:
        reads first, deletions last (they end ids that the others need)."""
        order = {"get": 0, "delete": 2}
        for path, method, operation in sorted(
            self.operations(), key=lambda op: order.get(op[1], 1)
        ):
            if self.succeeded(path, method) or not _answers_json(operation):
                continue
            params = [p for p in operation.get("parameters", []) if p["in"] == "path"]
            choices = [self.ids(p["name"])[:3] or ["x"] for p in params]
            for values in _product(choices):
                url = path
                for param, value in zip(params, values, strict=True):
                    url = url.replace("{" + param["name"] + "}", value)
                self.call(method.upper(), url, json_body=self.body_for(path, method, operation))
                if self.succeeded(path, method):
                    break


def _answers_json(operation: dict[str, Any]) -> bool:
    """Only JSON operations are swept (a streaming answer would never end)."""
    for status, response in operation.get("responses", {}).items():
        if status.startswith("2") and set(response.get("content", {})) - set(JSON_TYPES):
            return False
    return True


def _product(choices: list[list[str]]) -> Iterator[list[str]]:
    if not choices:
        yield []
        return
    for head in choices[0]:
        for rest in _product(choices[1:]):
            yield [head, *rest]


def _values_of(body: Any, key: str) -> Iterator[str]:
    if isinstance(body, dict):
        if isinstance(body.get(key), str):
            yield body[key]
        for value in body.get("items", []) if isinstance(body.get("items"), list) else []:
            yield from _values_of(value, key)
    elif isinstance(body, list):
        for value in body:
            yield from _values_of(value, key)


# ---------------------------------------------------------------------------------------------
# the flow


CTX, GEN = "walk-ctx", "walk-gen"
HELIX_CTX, HELIX_GEN = "walk-helix-ctx", "walk-helix-gen"


def _flow(walk: Walk) -> None:
    """Every route, with real bodies, in the order an engine and its workers use them."""
    call, get = walk.call, walk.json
    call("GET", "/healthz", expect=200)
    call("GET", "/readyz", expect=200)
    call("GET", "/metrics", expect=200)

    # Registration: whole (with a draft the peer lacks: a plan warning), then rank by rank.
    context = instance_body(role="context", tp=2)
    generation = instance_body(role="generation", tp=1, draft_heads=2, with_ranks=False)
    call("PUT", f"/v1/instances/{CTX}", json_body=context, expect=201)
    call("PUT", f"/v1/instances/{CTX}", json_body=context, expect=200)
    call("PUT", f"/v1/instances/{GEN}", json_body=generation, expect=201)
    gen_rank = rank_body(0, group_size=1, draft_heads=2)
    call("PUT", f"/v1/instances/{GEN}/ranks/0", json_body=gen_rank, expect=201)
    call("PUT", f"/v1/instances/{GEN}/ranks/0", json_body=gen_rank, expect=200)
    call("GET", "/v1/instances", expect=200)
    call("GET", f"/v1/instances/{CTX}", expect=200)
    # Helix (generation CP 2): routes with a CP side.
    view = [builders.ViewSpec("target", 2, 8, 64)]
    call(
        "PUT",
        f"/v1/instances/{HELIX_CTX}",
        json_body=builders.instance_body(role="context", views=view),
        expect=201,
    )
    call(
        "PUT",
        f"/v1/instances/{HELIX_GEN}",
        json_body=builders.instance_body(role="generation", views=view, cp=2),
        expect=201,
    )

    # Pairings and plans.
    pair = {"context": CTX, "generation": GEN}
    pairing = get("POST", "/v1/pairings", json_body=pair, expect=201)
    assert pairing["compatible"], pairing
    call("POST", "/v1/pairings", json_body=pair, expect=200)
    call("GET", "/v1/pairings", expect=200)
    call("GET", f"/v1/pairings/{pairing['id']}", expect=200)
    call("POST", f"/v1/pairings/{pairing['id']}/validate", expect=200)
    plan = get("GET", f"/v1/pairings/{pairing['id']}/plan", expect=200)
    assert plan["warnings"], "the flow wants a plan with warnings (draft without a peer)"
    helix = get(
        "POST",
        "/v1/pairings",
        json_body={"context": HELIX_CTX, "generation": HELIX_GEN},
        expect=201,
    )
    helix_plan = get("GET", f"/v1/pairings/{helix['id']}/plan", expect=200)
    assert {route["cp_side"] for route in helix_plan["routes"]} == {"generation"}
    inline = {
        "context": {**context, "name": CTX},
        "generation": {**generation, "ranks": [gen_rank], "name": GEN},
    }
    call("POST", "/v1/compatibility", json_body=inline, expect=200)

    # A planned transfer, replayed, read, expanded.
    transfer_body = {
        "context": CTX,
        "generation": GEN,
        "request_id": "walk-1",
        "blocks": {"0": {"context": [1, 2, 3], "generation": [4, 5, 6]}},
    }
    key = {"Idempotency-Key": "walk-1"}
    planned = get("POST", "/v1/transfers", json_body=transfer_body, headers=key, expect=201)
    call("POST", "/v1/transfers", json_body=transfer_body, headers=key, expect=200)
    call("GET", "/v1/transfers", expect=200)
    call("GET", f"/v1/transfers/{planned['id']}", expect=200)
    call("GET", f"/v1/transfers/{planned['id']}/fragments", expect=200)

    # Workers on every rank, their directories, an executed transfer and the parts they record.
    ranks = {CTX: context["ranks"], GEN: [gen_rank]}
    workers = {
        (name, body["rank"]): get(
            "POST",
            "/v1/workers",
            expect=201,
            json_body={
                "instance": name,
                "rank": body["rank"],
                "peer": fake_peer(body, f"walk-{name}-{body['rank']}"),
            },
        )["id"]
        for name, bodies in ranks.items()
        for body in bodies
    }
    call("GET", "/v1/workers", expect=200)
    directories = {}
    for key_, worker_id in workers.items():
        call("POST", f"/v1/workers/{worker_id}/heartbeat", expect=200)
        directories[key_] = get("GET", f"/v1/workers/{worker_id}/directory", expect=200)
    executed = get(
        "POST",
        "/v1/transfers",
        expect=201,
        json_body={**transfer_body, "request_id": "walk-2", "execute": True},
    )
    generation = directories[(GEN, gen_rank["rank"])]
    (pairing,) = [p for p in generation["pairings"] if p["context"] == CTX]
    sender = next(key_ for key_ in workers if key_[0] == CTX)
    record = {
        "transfer_id": executed["id"],
        "attempt": 1,
        "request_id": "walk-2",
        "pairing_id": pairing["id"],
        "context": CTX,
        "generation": GEN,
        "context_epoch": pairing["context_epoch"],
        "generation_epoch": pairing["generation_epoch"],
        "side": "send",
        "rank": sender[1],
        "status": "failed",
        "error": "walk",
        "bytes": 0,
        "started_at": time.time() - 1,
        "finished_at": time.time(),
    }
    call(
        "POST",
        "/v1/transfers/records",
        expect=200,
        json_body={"worker_id": workers[sender], "records": [record]},
    )
    call("GET", f"/v1/transfers/{executed['id']}/parts", expect=200)
    failed = get("GET", f"/v1/transfers/{executed['id']}", expect=200)
    assert failed["status"] == "failed", failed
    call("POST", f"/v1/transfers/{executed['id']}/retry", expect=200)

    # Problems the API documents.
    call("GET", "/v1/instances/nobody", expect=404)
    call("PUT", f"/v1/instances/{CTX}", json_body={"role": "context"}, expect=422)
    call("PUT", f"/v1/instances/{CTX}", content=b"{not json", expect=400)
    call("PUT", f"/v1/instances/{CTX}", json_body=context, headers={"If-Match": "999"}, expect=412)
    call(
        "POST",
        "/v1/transfers",
        json_body={**transfer_body, "request_id": "other"},
        headers=key,
        expect=409,
    )
    unknown_group = {"7": {"context": [1], "generation": [1]}}
    call(
        "POST",
        "/v1/transfers",
        expect=422,
        json_body={**transfer_body, "request_id": "walk-3", "blocks": unknown_group},
    )
    call("POST", f"/v1/transfers/{planned['id']}/retry", expect=409)
    bad_ctx = instance_body(role="context", tp=2, target_heads=4)  # 4 heads, the peer has 8
    call("PUT", "/v1/instances/walk-bad", json_body=bad_ctx, expect=201)
    incompatible = get(
        "POST", "/v1/pairings", json_body={"context": "walk-bad", "generation": GEN}, expect=201
    )
    call("GET", f"/v1/pairings/{incompatible['id']}/plan", expect=409)

    # Everything else the spec has, then the deletions (they end the ids the sweep uses).
    walk.sweep()
    call("DELETE", f"/v1/workers/{workers[(CTX, 0)]}", expect=204)
    call("DELETE", f"/v1/instances/{HELIX_GEN}", expect=204)


def _walk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Walk]:
    url = f"sqlite:///{tmp_path_factory.mktemp('walk') / 'walk.db'}"
    upgrade(url)
    app = create_app(Settings(database_url=url))
    with TestClient(app) as client:
        yield Walk(client, app.openapi())


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Walk]:
    for walk in _walk(tmp_path_factory):
        _flow(walk)
        yield walk


def test_the_sweep_reaches_reads_by_itself(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The generic part alone: with two instances and a pairing, it drives the reads."""
    for walk in _walk(tmp_path_factory):
        walk.call("PUT", f"/v1/instances/{CTX}", json_body=instance_body(role="context", tp=2))
        walk.call("PUT", f"/v1/instances/{GEN}", json_body=instance_body(role="generation", tp=1))
        walk.call("POST", "/v1/pairings", json_body={"context": CTX, "generation": GEN})
        walk.sweep()
        for path in (
            "/v1/instances/{name}",
            "/v1/pairings/{pairing_id}",
            "/v1/pairings/{pairing_id}/plan",
            "/v1/workers",
            "/v1/transfers",
        ):
            assert walk.succeeded(path, "get"), path
        # a body built from the request schema, with ids from the server, plans a transfer
        assert walk.succeeded("/v1/pairings/{pairing_id}/validate", "post")


# ---------------------------------------------------------------------------------------------
# the checks


def _schema_of(walk: Walk, x: Exchange) -> tuple[dict[str, Any], Any]:
    responses = walk.spec["paths"][x.path][x.method]["responses"]
    response = responses.get(str(x.status)) or responses.get("default")
    assert response is not None, f"{x.method.upper()} {x.url}: status {x.status} undocumented"
    content = response.get("content", {})
    declared = {media.split(";")[0].strip(): media for media in content}
    media = declared.get(x.content_type)
    return content, None if media is None else content[media].get("schema")


def test_every_answer_is_documented_and_declares_every_key(walked: Walk) -> None:
    problems: list[str] = []
    for x in walked.exchanges:
        where = f"{x.method.upper()} {x.url} → {x.status}"
        content, schema = _schema_of(walked, x)
        if not content:
            continue  # e.g. 204: nothing to check
        declared = {media.split(";")[0].strip(): media for media in content}
        if x.content_type not in declared:
            problems.append(f"{where}: content type {x.content_type!r} not in {sorted(content)}")
            continue
        if x.body is None or schema is None:
            continue
        for error in _validator(walked.spec, schema).iter_errors(x.body):
            problems.append(f"{where}: {error.message[:300]}")
        problems += [
            f"{where}: undeclared key {key}" for key in undeclared(walked.spec, schema, x.body)
        ]
    assert not problems, "\n".join(problems[:40])


def test_every_operation_answered_2xx(walked: Walk) -> None:
    """Every JSON operation (a non-JSON answer has no keys to walk; /metrics is called anyway)."""
    missing = [
        f"{method.upper()} {path}"
        for path, method, operation in walked.operations()
        if _answers_json(operation) and not walked.succeeded(path, method)
    ]
    assert not missing, (
        f"the walk got no 2xx from {missing}: its success schema is unchecked. Add a step for "
        "it to _flow in tests/contract/test_walk.py"
    )


def test_the_plan_and_transfer_fields_arrived_declared(walked: Walk) -> None:
    """The plan's and the transfer's fields that the spec once left untyped are sent and declared
    (the walk above checks every key against the spec)."""
    plans = [x.body for x in walked.exchanges if x.path.endswith("/plan") and x.status == 200]
    plan = plans[0]
    assert {
        "bytes_per_block",
        "context",
        "context_dp_rank",
        "generation",
        "generation_dp_rank",
        "pools",
        "runs",
        "tokens_per_block",
        "warnings",
    } <= set(plan)
    assert {"cp_modulus", "cp_remainder", "cp_side", "slices"} <= set(plan["routes"][0])
    assert "layer_group" in plan["routes"][0]["segments"][0]
    assert {"overlapping_ranks", "staging", "writer_ranks"} <= set(plan["receivers"][0])
    transfers = [
        x.body
        for x in walked.exchanges
        if x.path == "/v1/transfers" and x.method == "post" and x.status == 201
    ]
    assert {"blocks", "runs"} <= set(transfers[0]["routes"][0])


def test_one_problem_title_per_status(walked: Walk) -> None:
    titles: dict[int, set[str]] = {}
    for x in walked.exchanges:
        if x.content_type == "application/problem+json":
            titles.setdefault(x.status, set()).add(x.body["title"])
    assert {400, 404, 409, 412, 422} <= set(titles)
    assert titles == {status: {STATUS_TITLES[status]} for status in titles}


def test_instance_read_is_a_registration_body(walked: Walk) -> None:
    """What a client reads it can put back: the read minus read-only fields is a valid body."""
    read = walked.json("GET", f"/v1/instances/{CTX}", expect=200)
    body = {
        key: read[key]
        for key in walked.spec["components"]["schemas"]["InstanceCreate"]["properties"]
    }
    body["ranks"][0]["views"][0]["dtype"] = "float16"  # a change: new generation
    changed = walked.json("PUT", f"/v1/instances/{CTX}", json_body=body, expect=200)
    assert changed["generation"] == read["generation"] + 1
    assert changed["ranks"] == body["ranks"]
