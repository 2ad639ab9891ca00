"""Concurrent writers on one transfer or one receiver rank (real threads, real transactions).

On PostgreSQL (READ COMMITTED) each of these raced before the transfer row lock / the advisory
lock per receiver rank; on SQLite writers are serialized, so the tests hold there trivially.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from api.db import Database, utcnow
from api.errors import Conflict
from api.models import JobRow, TransferRow
from api.schemas_exec import JobComplete, JobFail
from api.services import jobs

from .conftest import setup_fleet, submit

HOLD_S = 0.5  # how long the first transaction stays open after its change


def _claim(db: Database, worker: str) -> tuple[str, str]:
    with db.write() as session:
        job = jobs.claim_job(session=session, worker_id=worker, now=utcnow())
        assert job is not None
        return job.id, str(job.lease_token)


def _first_then_second(db: Database, first: Callable[[Any], Any],
                       second: Callable[[Any], Any]) -> list[Any]:
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


def _failed_transfer(db: Database) -> str:
    """An executed fragments transfer whose only job failed for good (so it may be retried)."""
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1", mode="fragments")
    job_id, token = _claim(db, fleet["workers"][("ctx", 0)])
    with db.write() as session:
        jobs.fail_job(session=session, job_id=job_id,
                      body=JobFail(lease_token=token, reason="broken", retryable=False),
                      now=utcnow())
    return transfer_id


def _done(token: str) -> JobComplete:
    return JobComplete(lease_token=token, bytes=1, duration_s=0.0)


def test_the_last_two_jobs_completing_at_once_settle_the_transfer(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    transfer_id = submit(db, "r1")  # two send jobs and one receive job
    leases = [_claim(db, fleet["workers"][key]) for key in (("ctx", 0), ("ctx", 1), ("gen", 0))]
    with db.write() as session:
        jobs.complete_job(session=session, job_id=leases[0][0], body=_done(leases[0][1]),
                          now=utcnow())
    outcomes = _first_then_second(
        db,
        lambda s: jobs.complete_job(session=s, job_id=leases[1][0], body=_done(leases[1][1]),
                                    now=utcnow()),
        lambda s: jobs.complete_job(session=s, job_id=leases[2][0], body=_done(leases[2][1]),
                                    now=utcnow()),
    )
    assert not any(isinstance(outcome, Exception) for outcome in outcomes), outcomes
    with db.read() as session:
        assert session.get(TransferRow, transfer_id).status == "done"


def test_two_transfers_reserving_at_once_get_disjoint_staging_areas(db: Database) -> None:
    setup_fleet(db, ctx_tp=1, gen_tp=1)
    from api import schemas
    from api.services import transfers

    def create(request_id: str, execute: bool = True) -> Callable[[Any], str]:
        def run(session: Any) -> str:
            body = schemas.TransferCreate.model_validate({
                "context": "ctx", "generation": "gen", "request_id": request_id,
                "blocks": {"0": {"context": [0, 1, 2, 3], "generation": [0, 1, 2, 3]}},
                "execute": execute,
            })
            row, _ = transfers.create_transfer(session=session, body=body)
            return row.id
        return run

    with db.write() as session:  # the plan is stored first, so the two only meet on staging
        create("warm", execute=False)(session)
    outcomes = _first_then_second(db, create("a"), create("b"))
    assert all(isinstance(outcome, str) for outcome in outcomes), outcomes
    with db.read() as session:
        areas = sorted(
            (row.staging_offset, row.staging_offset + row.staging_bytes)
            for row in session.query(JobRow).filter(JobRow.kind == "receive")
        )
    assert len(areas) == 2 and areas[0][1] <= areas[1][0], areas


def test_two_retries_at_once_enqueue_one_attempt(db: Database) -> None:
    transfer_id = _failed_transfer(db)

    def retry(session: Any) -> int:
        return jobs.retry_transfer(session=session, transfer_id=transfer_id,
                                   now=utcnow()).attempt

    outcomes = _first_then_second(db, retry, retry)
    assert outcomes[0] == 2
    assert isinstance(outcomes[1], Conflict) and outcomes[1].code == "transfer_not_retryable"
    with db.read() as session:
        attempt_two = session.query(JobRow).filter(
            JobRow.transfer_id == transfer_id, JobRow.attempt == 2
        ).count()
    assert attempt_two == 1  # one send job (fragments mode), not two


@pytest.mark.parametrize("change", ["num_slots"])
def test_a_retry_after_a_re_registration_is_refused(db: Database, change: str) -> None:
    from api import schemas
    from api.services import instances

    from .conftest import fleet_bodies

    transfer_id = _failed_transfer(db)
    ctx, _ = fleet_bodies(1, 1)
    for rank in ctx["ranks"]:
        rank["pools"][0][change] *= 2  # a new memory layout
    with db.write() as session:
        instances.register_instance(session=session, name="ctx",
                                    body=schemas.InstanceCreate.model_validate(ctx))
    with pytest.raises(Conflict) as refused, db.write() as session:
        jobs.retry_transfer(session=session, transfer_id=transfer_id, now=utcnow())
    assert refused.value.code == "plan_gone"


def test_a_pairing_validated_during_a_re_registration_is_never_left_current(db: Database) -> None:
    """Issue 13 item 4: ``PUT /v1/instances/ctx`` (held open) racing ``POST /v1/pairings``.

    The pairing must end either stale or validated against the new epoch; before the fix it was
    stored ``compatible`` with the old epoch on PostgreSQL (it read the instance, then waited on
    the pairing row the re-registration had marked stale, then overwrote the mark).
    """
    from api import schemas
    from api.models import InstanceRow, PairingRow
    from api.services import instances, pairings

    from .conftest import fleet_bodies

    setup_fleet(db, ctx_tp=1, gen_tp=1)
    ctx, _ = fleet_bodies(1, 1)
    ctx["ranks"][0]["pools"][0]["num_slots"] *= 2

    def re_register(session: Any) -> str:
        row, _, changed = instances.register_instance(
            session=session, name="ctx", body=schemas.InstanceCreate.model_validate(ctx)
        )
        assert changed
        return row.epoch

    def pair(session: Any) -> str:
        row, _ = pairings.create_pairing(session=session, context="ctx", generation="gen")
        return row.status

    outcomes = _first_then_second(db, re_register, pair)
    assert not any(isinstance(outcome, Exception) for outcome in outcomes), outcomes
    with db.read() as session:
        pairing = session.query(PairingRow).one()
        epoch = session.query(InstanceRow).filter(InstanceRow.name == "ctx").one().epoch
        assert epoch == outcomes[0]
        assert pairing.status == "stale" or pairing.context_epoch == epoch, (
            pairing.status, pairing.context_epoch, epoch
        )
