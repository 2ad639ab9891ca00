"""What the control plane does with dispatched transfers and the parts workers record."""

from __future__ import annotations

from datetime import timedelta

import pytest

from api.db import Database, utcnow
from api.errors import Conflict, Forbidden, Unavailable
from api.services import execution, registration, stats
from api.services import transfers as transfer_service
from api.services import workers as worker_service

from .conftest import attach_worker, record, setup_fleet, status_of, submit


def test_dispatch_sends_one_command_per_rank_taking_part(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    commands: list = []
    transfer_id = submit(db, "r1", commands=commands)
    by_worker = {worker: command for worker, command in commands}
    assert set(by_worker) == set(fleet["workers"].values())
    sides = sorted((c["side"], c["rank"]) for c in by_worker.values())
    assert sides == [("receive", 0), ("send", 0), ("send", 1)]
    assert {c["xid"] for c in by_worker.values()} == {f"{transfer_id}.1"}
    assert status_of(db, transfer_id) == ("running", None)


def test_dispatch_without_a_live_worker_is_503_and_writes_nothing(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    with db.write() as session:
        worker_service.stop_worker(session=session, worker_id=fleet["workers"][("ctx", 1)])
    with pytest.raises(Unavailable) as caught:
        submit(db, "r1")
    assert caught.value.code == "workers_unavailable"
    assert "context rank 1" in caught.value.detail
    with db.read() as session:
        assert execution.list_parts(session=session) == []
        assert stats.transfer_ids_of_instance(session=session, name="ctx") == []


def test_done_when_every_receiver_recorded_its_part(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    transfer_id = submit(db, "r1")
    record(db, fleet["workers"][("ctx", 0)], transfer_id, side="send", rank=0)
    assert status_of(db, transfer_id)[0] == "running"
    accepted, settled = record(
        db, fleet["workers"][("gen", 0)], transfer_id, side="receive", rank=0
    )
    assert (accepted, settled) == (1, [transfer_id])
    assert status_of(db, transfer_id) == ("done", None)
    # A sender's part that arrives later is stored, and changes nothing.
    record(db, fleet["workers"][("ctx", 1)], transfer_id, side="send", rank=1)
    with db.read() as session:
        assert len(execution.list_parts(session=session, transfer_id=transfer_id)) == 3
    assert status_of(db, transfer_id) == ("done", None)


def test_a_repeated_record_counts_once(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1")
    worker = fleet["workers"][("ctx", 0)]
    assert record(db, worker, transfer_id, side="send", rank=0)[0] == 1
    assert record(db, worker, transfer_id, side="send", rank=0)[0] == 0
    with db.read() as session:
        assert len(execution.list_parts(session=session, transfer_id=transfer_id)) == 1


def test_one_failed_part_fails_the_transfer_with_its_reason(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    transfer_id = submit(db, "r1")
    record(
        db,
        fleet["workers"][("ctx", 1)],
        transfer_id,
        side="send",
        rank=1,
        status="failed",
        error="deadline: 30 s passed; no grant from gen rank 0",
    )
    status, error = status_of(db, transfer_id)
    assert status == "failed"
    assert error == "context rank 1: deadline: 30 s passed; no grant from gen rank 0"
    # The receiver's success afterwards does not resurrect it.
    record(db, fleet["workers"][("gen", 0)], transfer_id, side="receive", rank=0)
    assert status_of(db, transfer_id)[0] == "failed"


def test_verify_waits_for_senders_and_compares_checksums(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    good = submit(db, "good", verify=True)
    record(
        db, fleet["workers"][("gen", 0)], good, side="receive", rank=0, checksum=7, routes=[(0, 0)]
    )
    assert status_of(db, good)[0] == "running"  # the sender's crc32 is still missing
    record(db, fleet["workers"][("ctx", 0)], good, side="send", rank=0, checksum=7, routes=[(0, 0)])
    assert status_of(db, good) == ("done", None)

    bad = submit(db, "bad", verify=True)
    record(db, fleet["workers"][("ctx", 0)], bad, side="send", rank=0, checksum=7, routes=[(0, 0)])
    record(
        db, fleet["workers"][("gen", 0)], bad, side="receive", rank=0, checksum=8, routes=[(0, 0)]
    )
    status, error = status_of(db, bad)
    assert status == "failed"
    assert error is not None and error.startswith("checksum_mismatch: route 0->0")


def test_verify_settles_on_receivers_that_compared_the_senders_sums(db: Database) -> None:
    """A receive part that carries its sender's crc32 beside its own (the rank compared them
    before it said arrived) settles its routes without send parts; a route without it still
    waits for its sender; a receive part whose two sums differ fails the transfer."""
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    gen, ctx1 = fleet["workers"][("gen", 0)], fleet["workers"][("ctx", 1)]
    both = submit(db, "both", verify=True)
    record(
        db, gen, both, side="receive", rank=0, checksum=7, sender_checksum=7,
        routes=[(0, 0), (1, 0)],
    )  # fmt: skip
    assert status_of(db, both) == ("done", None)

    half = submit(db, "half", verify=True)
    record(db, gen, half, side="receive", rank=0, checksum=7, sender_checksum=7, routes=[(0, 0)])
    assert status_of(db, half)[0] == "running"  # route 1->0 was not compared: its sender's sum
    record(db, ctx1, half, side="send", rank=1, checksum=7, routes=[(1, 0)])
    assert status_of(db, half) == ("done", None)

    told = submit(db, "told", verify=True)
    record(
        db, gen, told, side="receive", rank=0, checksum=8, sender_checksum=7,
        routes=[(0, 0), (1, 0)],
    )  # fmt: skip
    status, error = status_of(db, told)
    assert status == "failed"
    assert error == "checksum_mismatch: route 0->0: sender crc32 7, receiver crc32 8"


def test_records_of_an_older_attempt_change_nothing(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1")
    record(
        db,
        fleet["workers"][("ctx", 0)],
        transfer_id,
        side="send",
        rank=0,
        status="failed",
        error="boom",
    )
    with db.write() as session:
        _, commands = execution.retry_transfer(
            session=session, transfer_id=transfer_id, now=utcnow()
        )
    assert {c["attempt"] for _, c in commands} == {2}
    assert status_of(db, transfer_id) == ("running", None)
    # attempt 1's receiver reports late: ignored
    accepted, _ = record(
        db, fleet["workers"][("gen", 0)], transfer_id, side="receive", rank=0, attempt=1
    )
    assert accepted == 0
    record(db, fleet["workers"][("gen", 0)], transfer_id, side="receive", rank=0, attempt=2)
    assert status_of(db, transfer_id) == ("done", None)


def test_only_a_failed_executed_transfer_can_be_retried(db: Database) -> None:
    setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1")
    with db.write() as session, pytest.raises(Conflict) as caught:
        execution.retry_transfer(session=session, transfer_id=transfer_id, now=utcnow())
    assert caught.value.code == "transfer_not_retryable"


def test_a_worker_records_only_its_own_rank(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    transfer_id = submit(db, "r1")
    with pytest.raises(Forbidden):
        record(db, fleet["workers"][("ctx", 0)], transfer_id, side="send", rank=1)
    with pytest.raises(Forbidden):
        record(db, fleet["workers"][("ctx", 0)], transfer_id, side="receive", rank=0)


def test_overdue_transfers_fail_naming_the_silent_ranks(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    transfer_id = submit(db, "r1", timeout_s=1.0)
    record(db, fleet["workers"][("ctx", 0)], transfer_id, side="send", rank=0)
    with db.write() as session:
        assert execution.reap_overdue(session=session, now=utcnow()) == []  # not yet
        later = utcnow() + timedelta(seconds=1.0 + execution.RECORD_GRACE_S + 1)
        assert execution.reap_overdue(session=session, now=later) == [transfer_id]
    status, error = status_of(db, transfer_id)
    assert status == "failed"
    assert error is not None and "context rank 1, generation rank 0" in error


def test_a_reregistration_fails_running_transfers(db: Database) -> None:
    from api import schemas
    from geometry.builders import ViewSpec, instance_body

    setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1")
    changed = instance_body(
        role="generation",
        views=[ViewSpec("target", 2, 4, 8)],
        tp=1,
        tokens_per_block=4,
        num_slots=32,
    )
    with db.write() as session:
        registration.register_instance(
            session=session, name="gen", body=schemas.InstanceCreate.model_validate(changed)
        )
    status, error = status_of(db, transfer_id)
    assert status == "failed"
    assert error is not None and "peer_restarted" in error


def test_engine_records_create_one_transfer_per_request(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    blocks = {"0": {"context": [0, 1], "generation": [5, 6]}}
    for rank in (0, 1):
        record(
            db, fleet["workers"][("ctx", rank)], None, side="send", rank=rank, request_id="req-7"
        )
    record(
        db,
        fleet["workers"][("gen", 0)],
        None,
        side="receive",
        rank=0,
        request_id="req-7",
        blocks=blocks,
    )
    with db.read() as session:
        rows, total = transfer_service.list_transfers(session=session)
    assert total == 1
    row = rows[0]
    assert (row.request_id, row.status, row.execute) == ("req-7", "done", True)
    assert row.bytes > 0 and row.blocks == blocks  # expanded from the plan the workers used
    assert len({r["sender_rank"] for r in row.summary["routes"]}) == 2


def test_an_engine_transfer_is_described_by_its_first_record_with_blocks(db: Database) -> None:
    """The row is complete from the first record that carries the block lists (the insert
    describes it), a sender's part leaves it running, and the receiver's part settles it."""
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    blocks = {"0": {"context": [3, 4, 5], "generation": [7, 8, 9]}}
    record(
        db,
        fleet["workers"][("ctx", 1)],
        None,
        side="send",
        rank=1,
        request_id="req-9",
        blocks=blocks,
    )
    with db.read() as session:
        rows, _ = transfer_service.list_transfers(session=session)
    assert [(r.status, r.blocks) for r in rows] == [("running", blocks)]
    assert rows[0].pairing_id is not None and rows[0].plan_id is not None
    assert rows[0].bytes > 0 and len(rows[0].summary["routes"]) == 2
    record(
        db,
        fleet["workers"][("ctx", 0)],
        None,
        side="send",
        rank=0,
        request_id="req-9",
        blocks=blocks,
    )
    accepted, settled = record(
        db,
        fleet["workers"][("gen", 0)],
        None,
        side="receive",
        rank=0,
        request_id="req-9",
        blocks=blocks,
    )
    assert (accepted, settled) == (1, [rows[0].id])
    with db.read() as session:
        row = transfer_service.get_transfer(session=session, transfer_id=rows[0].id)
        assert (row.status, row.blocks, row.bytes) == ("done", blocks, rows[0].bytes)


def test_reaping_overdue_transfers_is_bounded_per_call(db: Database) -> None:
    """A rank whose worker vanished leaves many dispatched transfers behind; one request fails a
    bounded batch of them, never all at once, so no request does unbounded work, and the next
    calls take the rest."""
    setup_fleet(db, ctx_tp=1, gen_tp=1)
    ids = [submit(db, f"r{i}", timeout_s=1.0) for i in range(7)]
    later = utcnow() + timedelta(seconds=1.0 + execution.RECORD_GRACE_S + 1)
    with db.write() as session:
        first = execution.reap_overdue(session=session, now=later, limit=3)
    with db.write() as session:
        second = execution.reap_overdue(session=session, now=later, limit=3)
    with db.write() as session:
        third = execution.reap_overdue(session=session, now=later, limit=3)
    assert (len(first), len(second), len(third)) == (3, 3, 1)
    assert sorted(first + second + third) == sorted(ids)
    assert all(status_of(db, tid)[0] == "failed" for tid in ids)


def _owed_to(db: Database, worker_id: str) -> list:
    with db.read() as session:
        return execution.commands_owed_to(session=session, worker_id=worker_id, now=utcnow())


def test_a_stream_that_opens_is_owed_the_commands_its_rank_has_not_recorded(
    db: Database,
) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    workers = fleet["workers"]
    commands: list = []
    transfer_id = submit(db, "r1", commands=commands)
    sent = dict(commands)
    for worker_id in workers.values():  # what dispatch sent, less the time already gone
        ((owed_worker, owed),) = _owed_to(db, worker_id)
        assert owed_worker == worker_id
        assert {**owed, "timeout_s": 0} == {**sent[worker_id], "timeout_s": 0}
        assert 0 < owed["timeout_s"] <= sent[worker_id]["timeout_s"]
    record(db, workers[("ctx", 0)], transfer_id, side="send", rank=0)
    assert _owed_to(db, workers[("ctx", 0)]) == []  # recorded: nothing owed
    assert len(_owed_to(db, workers[("ctx", 1)])) == 1
    # A replay is owed what no rank recorded yet.
    with db.read() as session:
        row = transfer_service.get_transfer(session=session, transfer_id=transfer_id)
        owed = execution.commands_owed(session=session, now=utcnow(), transfers=[row])
    assert sorted(c["rank"] for _, c in owed) == [0, 1] and len(owed) == 2
    record(db, workers[("gen", 0)], transfer_id, side="receive", rank=0)
    assert status_of(db, transfer_id)[0] == "done"
    assert [_owed_to(db, w) for w in workers.values()] == [[], [], []]


def test_nothing_is_owed_for_engine_path_transfers_or_to_a_newer_worker(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    workers = fleet["workers"]
    # An engine-path transfer is running until every rank's record is in; nobody dispatched it.
    later = utcnow().timestamp() + 5  # started after every worker attached
    record(
        db,
        workers[("ctx", 0)],
        None,
        side="send",
        rank=0,
        request_id="engine-1",
        blocks={"0": {"context": [0, 1], "generation": [2, 3]}},
        started_at=later,
        finished_at=later + 0.001,
    )
    assert [_owed_to(db, w) for w in workers.values()] == [[], [], []]
    # A worker that attached after the dispatch (a restarted worker process) is not the one
    # the command went to: it gets nothing.
    submit(db, "r1")
    restarted = attach_worker(db, "gen", 0, "gen.r0.new", utcnow() + timedelta(seconds=1))
    assert _owed_to(db, restarted) == []
