"""Concurrent writers on one transfer or one pairing (real threads, real transactions).

On PostgreSQL (READ COMMITTED) each of these raced before its lock (the transfer row for records
and retries; the instances ``FOR SHARE`` for pairings); on SQLite writers are serialized, so the
tests hold there trivially.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from api.db import Database, utcnow
from api.errors import Conflict
from api.services import execution

from .conftest import fleet_bodies, record, setup_fleet, status_of, submit

HOLD_S = 0.5  # how long the first transaction stays open after its change


def _first_then_second(
    db: Database, first: Callable[[Any], Any], second: Callable[[Any], Any]
) -> list[Any]:
    """Run ``first`` in a transaction held open ``HOLD_S`` after it ran, and ``second`` in
    another transaction started meanwhile; returns both outcomes (a value or an exception)."""
    outcomes: list[Any] = [None, None]
    ran = threading.Event()

    def hold() -> None:
        try:
            with db.write() as session:
                outcomes[0] = first(session)
                ran.set()
                time.sleep(HOLD_S)
        except Exception as error:  # reported to the test
            outcomes[0] = error
            ran.set()

    thread = threading.Thread(target=hold)
    thread.start()
    assert ran.wait(10)
    try:
        with db.write() as session:
            outcomes[1] = second(session)
    except Exception as error:
        outcomes[1] = error
    thread.join(10)
    return outcomes


def _body(fleet: dict[str, Any], transfer_id: str, rank: int) -> Any:
    from sqlalchemy import select

    from api import schemas_exec
    from api.models import InstanceRow, PairingRow

    return lambda session: execution.record_parts(
        session=session,
        now=utcnow(),
        body=(
            schemas_exec.TransferRecords.model_validate(
                {
                    "worker_id": fleet["workers"][("gen", rank)],
                    "records": [
                        {
                            "transfer_id": transfer_id,
                            "request_id": "r",
                            "pairing_id": session.scalar(select(PairingRow.id)),
                            "context": "ctx",
                            "generation": "gen",
                            "context_epoch": session.scalar(
                                select(InstanceRow.epoch).where(InstanceRow.name == "ctx")
                            ),
                            "generation_epoch": session.scalar(
                                select(InstanceRow.epoch).where(InstanceRow.name == "gen")
                            ),
                            "side": "receive",
                            "rank": rank,
                            "status": "done",
                            "bytes": 1,
                            "started_at": time.time(),
                            "finished_at": time.time(),
                        }
                    ],
                }
            )
        ),
    )


def test_the_last_two_parts_recorded_at_once_settle_the_transfer_once(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=2)
    transfer_id = submit(db, "r1")
    outcomes = _first_then_second(db, _body(fleet, transfer_id, 0), _body(fleet, transfer_id, 1))
    assert not any(isinstance(o, Exception) for o in outcomes), outcomes
    settled = [tid for _, ids in outcomes for tid in ids]
    assert settled == [transfer_id]  # exactly one of the two finished it
    assert status_of(db, transfer_id) == ("done", None)


def test_two_retries_at_once_dispatch_one_attempt(db: Database) -> None:
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

    def retry(session: Any) -> Any:
        return execution.retry_transfer(session=session, transfer_id=transfer_id, now=utcnow())

    outcomes = _first_then_second(db, retry, retry)
    assert isinstance(outcomes[0], tuple), outcomes
    assert isinstance(outcomes[1], Conflict) and outcomes[1].code == "transfer_not_retryable"
    assert status_of(db, transfer_id) == ("running", None)


def test_a_retry_after_a_re_registration_is_refused(db: Database) -> None:
    from api import schemas
    from api.services import registration

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
    ctx, _ = fleet_bodies(1, 1)
    for rank in ctx["ranks"]:
        rank["pools"][0]["num_slots"] *= 2  # a new memory layout
    with db.write() as session:
        registration.register_instance(
            session=session, name="ctx", body=schemas.InstanceCreate.model_validate(ctx)
        )
    with pytest.raises(Conflict) as refused, db.write() as session:
        execution.retry_transfer(session=session, transfer_id=transfer_id, now=utcnow())
    assert refused.value.code == "plan_gone"


def test_a_pairing_validated_during_a_re_registration_is_never_left_current(db: Database) -> None:
    """``PUT /v1/instances/ctx`` (held open) racing ``POST /v1/pairings``.

    The pairing must end either stale or validated against the new epoch; before the fix it was
    stored ``compatible`` with the old epoch on PostgreSQL (it read the instance, then waited on
    the pairing row the re-registration had marked stale, then overwrote the mark).
    """
    from api import schemas
    from api.models import InstanceRow, PairingRow
    from api.services import pairings, registration

    setup_fleet(db, ctx_tp=1, gen_tp=1)
    ctx, _ = fleet_bodies(1, 1)
    ctx["ranks"][0]["pools"][0]["num_slots"] *= 2

    def re_register(session: Any) -> str:
        row, _, changed = registration.register_instance(
            session=session, name="ctx", body=schemas.InstanceCreate.model_validate(ctx)
        )
        assert changed
        return str(row.epoch)

    def pair(session: Any) -> str:
        row, _ = pairings.create_pairing(session=session, context="ctx", generation="gen")
        return str(row.status)

    outcomes = _first_then_second(db, re_register, pair)
    assert not any(isinstance(outcome, Exception) for outcome in outcomes), outcomes
    with db.read() as session:
        pairing = session.query(PairingRow).one()
        epoch = session.query(InstanceRow).filter(InstanceRow.name == "ctx").one().epoch
        assert epoch == outcomes[0]
        assert pairing.status == "stale" or pairing.context_epoch == epoch, (
            pairing.status,
            pairing.context_epoch,
            epoch,
        )
