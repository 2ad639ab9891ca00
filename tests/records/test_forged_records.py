"""A worker's records cannot forge state: times, peers, ranks, blocks and metrics (HTTP)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from geometry.builders import ViewSpec, instance_body

from .conftest import engine_record, fleet_over_http

VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]


def _post(api: TestClient, worker_id: str, *records: dict[str, Any]) -> Any:
    return api.post(
        "/v1/transfers/records", json={"worker_id": worker_id, "records": list(records)}
    )


def _transfers(api: TestClient) -> list[dict[str, Any]]:
    return list(api.get("/v1/transfers").json()["items"])


@pytest.mark.parametrize(
    "field, value",
    [
        ("started_at", 10 * 365.25 * 86400),  # added to now: ten years ahead
        ("finished_at", 3600.0),  # an hour ahead
        ("started_at", -3 * 86400),  # three days ago
        ("finished_at", -1.0),  # before it started
    ],
)
def test_record_times_outside_the_control_planes_window_are_refused(
    client: TestClient, field: str, value: float
) -> None:
    fleet = fleet_over_http(client)
    record = engine_record(fleet, "receive", 0)
    record[field] = record["started_at"] + value
    if field == "started_at" and value > 0:
        record["finished_at"] = record["started_at"] + 1
    answer = _post(client, fleet["gen"][0], record)
    assert answer.status_code == 422, answer.text
    assert answer.json()["code"] == "record_time_out_of_range"
    assert answer.json()["errors"][0]["loc"][:3] == ["body", "records", 0]
    assert _transfers(client) == []  # nothing stored: no transfer running until 2126


@pytest.mark.parametrize("raw", ["1e12", "253402300799", "Infinity", "NaN", "1e400"])
def test_record_times_outside_the_datetime_range_are_422_not_500(
    client: TestClient, raw: str
) -> None:
    fleet = fleet_over_http(client)
    record = engine_record(fleet, "receive", 0)
    body = json.dumps({"worker_id": fleet["gen"][0], "records": [record]})
    body = body.replace(json.dumps(record["finished_at"]), raw)
    answer = client.post(
        "/v1/transfers/records", content=body, headers={"Content-Type": "application/json"}
    )
    assert answer.status_code == 422, answer.text
    assert _transfers(client) == []


def test_an_engine_record_must_name_its_own_instances_pairing(client: TestClient) -> None:
    fleet = fleet_over_http(client)
    victim = instance_body(role="generation", views=VIEWS, tp=1, tokens_per_block=4)
    assert client.put("/v1/instances/victim", json=victim).status_code == 201
    victim_epoch = client.get("/v1/instances/victim").json()["epoch"]
    # The context worker makes up a "ctx -> victim" transfer with its own pairing's id, or
    # with an id that names no pairing at all.
    for pairing_id in (fleet["pairing"], "no-such-pairing"):
        forged = engine_record(
            fleet,
            "send",
            0,
            generation="victim",
            generation_epoch=victim_epoch,
            pairing_id=pairing_id,
            status="failed",
            error="forged",
        )
        answer = _post(client, fleet["ctx"][0], forged)
        assert answer.status_code == 403, answer.text
        assert answer.json()["code"] == "pairing_mismatch"
    assert _transfers(client) == []
    # Its own pairing's record is stored as before.
    assert _post(client, fleet["gen"][0], engine_record(fleet, "receive", 0)).status_code == 200
    assert [t["status"] for t in _transfers(client)] == ["done"]


def test_a_rank_that_takes_no_part_cannot_fail_an_engine_transfer(client: TestClient) -> None:
    # Attention-DP generation (TP2): a transfer to DP rank 0 lands on generation rank 0 only.
    fleet = fleet_over_http(client, ctx_tp=1, gen_tp=2, gen_dp=True)
    outsider = engine_record(
        fleet, "receive", 1, generation_dp_rank=0, status="failed", error="forged"
    )
    answer = _post(client, fleet["gen"][1], outsider)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"accepted": 0, "settled": []}
    (transfer,) = _transfers(client)
    assert transfer["status"] == "running"
    # The rank that takes part settles it.
    answer = _post(
        client, fleet["gen"][0], engine_record(fleet, "receive", 0, generation_dp_rank=0)
    )
    assert answer.json()["accepted"] == 1
    assert [t["status"] for t in _transfers(client)] == ["done"]


def test_a_rank_that_takes_no_part_cannot_fail_a_rest_transfer(client: TestClient) -> None:
    fleet = fleet_over_http(client, ctx_tp=1, gen_tp=2, gen_dp=True)
    answer = client.post(
        "/v1/transfers",
        json={
            "context": "ctx",
            "generation": "gen",
            "request_id": "r1",
            "execute": True,
            "generation_dp_rank": 0,
            "blocks": {"0": {"context": [0, 1], "generation": [2, 3]}},
        },
    )
    assert answer.status_code == 201, answer.text
    transfer = answer.json()
    assert {route["receiver_rank"] for route in transfer["routes"]} == {0}
    forged = engine_record(
        fleet,
        "receive",
        1,
        transfer_id=transfer["id"],
        generation_dp_rank=0,
        status="failed",
        error="forged",
    )
    assert _post(client, fleet["gen"][1], forged).json() == {"accepted": 0, "settled": []}
    assert client.get(f"/v1/transfers/{transfer['id']}").json()["status"] == "running"


@pytest.mark.parametrize(
    "blocks",
    [
        {"0": {"context": [0, 1], "generation": [10_000, 10_001]}},  # beyond the pool's slots
        {"0": {"context": [0, 0], "generation": [2, 3]}},  # repeated
        {"7": {"context": [0], "generation": [1]}},  # no such layer group
        {"x": {"context": [0], "generation": [1]}},  # not a layer group at all
        {"0": {"context": [0, 1]}},  # no generation list
        {"0": {"generation": [2, 3]}},  # no context list
        {"0": {"context": [0, 1], "generation": [2, 3], "draft": [4]}},  # a side that is none
    ],
)
def test_an_engine_record_whose_blocks_cannot_be_expanded_is_refused(
    client: TestClient, blocks: dict[str, Any]
) -> None:
    fleet = fleet_over_http(client)
    answer = _post(
        client, fleet["gen"][0], engine_record(fleet, "receive", 0, blocks=blocks, bytes=0)
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["code"] == "invalid_blocks"
    assert _transfers(client) == []  # not settled "done" with 0 bytes


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_only_records_that_changed_state(client: TestClient) -> None:
    fleet = fleet_over_http(client)
    record = engine_record(fleet, "receive", 0, bytes=1000)
    for _ in range(5):  # a batch retried five times
        assert _post(client, fleet["gen"][0], record).status_code == 200
    bogus = [
        engine_record(fleet, "receive", 0, transfer_id=f"bogus{i}", bytes=1 << 50)
        for i in range(20)
    ]  # transfers that do not exist
    assert _post(client, fleet["gen"][0], *bogus).json() == {"accepted": 0, "settled": []}
    text = client.get("/metrics").text
    assert _metric(text, "kvplane_moved_bytes_total", kind="receive") == 1000
    assert _metric(text, "kvplane_recorded_parts_total", state="done") == 1


def test_a_refused_record_fails_the_transfer_it_names_at_once(client: TestClient) -> None:
    """The sender's record opened the transfer without block lists (a record may leave them
    to another); the receiver's names no generation list. The receiver's batch is refused, and
    the transfer fails now with the reason, instead of waiting as `running` for a part that
    will never be stored."""
    fleet = fleet_over_http(client)
    opened = _post(client, fleet["ctx"][0], engine_record(fleet, "send", 0, blocks=None))
    assert opened.status_code == 200, opened.text
    (transfer,) = _transfers(client)
    assert transfer["status"] == "running"
    bad = engine_record(fleet, "receive", 0, blocks={"0": {"context": [0, 1]}})
    answer = _post(client, fleet["gen"][0], bad)
    assert answer.status_code == 422 and answer.json()["code"] == "invalid_blocks"
    assert answer.json()["transfer_id"] == transfer["id"]
    failed = client.get(f"/v1/transfers/{transfer['id']}").json()
    assert failed["status"] == "failed"
    assert "needs a context and a generation list" in failed["error"]
