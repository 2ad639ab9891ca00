"""Job lifecycle, injected clock: leases, fencing, retries, epochs, staging, checksums."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from api import schemas
from api.db import Database, utcnow
from api.errors import BadRequest, Conflict, LeaseLost, Unavailable
from api.models import JobRow, TransferRow
from api.schemas_exec import JobComplete, JobFail
from api.services import instances, jobs

from .conftest import attach_worker, fleet_bodies, setup_fleet, submit

TTL = timedelta(seconds=jobs.LEASE_TTL_S)


def claim(db: Database, worker: str, now: Any) -> tuple[str, str, str, dict[str, Any]] | None:
    with db.write() as session:
        job = jobs.claim_job(session=session, worker_id=worker, now=now)
        if job is None:
            return None
        return job.id, str(job.lease_token), job.kind, dict(job.payload)


def complete(db: Database, job_id: str, token: str, now: Any, **result: Any) -> None:
    body = JobComplete(lease_token=token, bytes=result.pop("bytes", 1), duration_s=0.0,
                       **result)
    with db.write() as session:
        jobs.complete_job(session=session, job_id=job_id, body=body, now=now)


def transfer(db: Database, transfer_id: str) -> TransferRow:
    with db.read() as session:
        row = session.get(TransferRow, transfer_id)
        assert row is not None
        return row


def job_rows(db: Database, transfer_id: str) -> list[JobRow]:
    with db.read() as session:
        return jobs.list_jobs(session=session, transfer_id=transfer_id)


def beat(db: Database, now: Any, *workers: str) -> None:
    with db.write() as session:
        for worker in workers:
            jobs.heartbeat(session=session, worker_id=worker, now=now)


def test_staged_transfer_reserves_exact_offsets_and_settles_done(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    transfer_id = submit(db, "r1", verify=True)
    rows = job_rows(db, transfer_id)
    assert sorted((row.kind, row.rank) for row in rows) == [
        ("receive", 0), ("send", 0), ("send", 1)
    ]
    receive = next(row for row in rows if row.kind == "receive")
    sends = {row.rank: row for row in rows if row.kind == "send"}
    # two writers (heads 0-1 and 2-3) share generation rank 0's staging area back to back
    offsets = [entry["dst_offset"] for rank in (0, 1) for entry in sends[rank].payload["routes"]]
    sizes = [entry["bytes"] for entry in receive.payload["routes"]]
    assert offsets == [receive.staging_offset, receive.staging_offset + sizes[0]]
    assert receive.staging_bytes == sum(sizes) == transfer(db, transfer_id).bytes
    # the receive job is bound to the worker whose staging area it reserved
    assert receive.worker_id == fleet["workers"][("gen", 0)]

    now = utcnow()
    leases = {}
    for key in (("ctx", 0), ("ctx", 1), ("gen", 0)):
        got = claim(db, fleet["workers"][key], now)
        assert got is not None
        leases[key] = got
        # peers' current NIXL endpoints are attached at claim time
        assert got[3]["peers"]
    assert transfer(db, transfer_id).status == "running"
    for key, (job_id, token, _kind, payload) in leases.items():
        routes = [{"sender_rank": r.get("sender_rank", key[1]),
                   "receiver_rank": r.get("receiver_rank", 0), "bytes": r["bytes"],
                   "checksum": 1234} for r in payload["routes"]]
        complete(db, job_id, token, now, bytes=sum(r["bytes"] for r in routes), routes=routes)
    done = transfer(db, transfer_id)
    assert done.status == "done" and done.error is None


def test_fragments_with_verify_get_a_pinned_receive_job_per_receiver(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    transfer_id = submit(db, "checked", mode="fragments", verify=True)
    rows = job_rows(db, transfer_id)
    assert sorted((row.kind, row.rank) for row in rows) == [
        ("receive", 0), ("send", 0), ("send", 1)
    ]
    receive = next(row for row in rows if row.kind == "receive")
    gen_worker = fleet["workers"][("gen", 0)]
    assert receive.worker_id == gen_worker
    assert receive.staging_bytes == 0  # nothing reserved: the fragments land in the pools
    assert sorted(r["sender_rank"] for r in receive.payload["routes"]) == [0, 1]
    assert sum(r["bytes"] for r in receive.payload["routes"]) == transfer(db, transfer_id).bytes
    sends = [row for row in rows if row.kind == "send"]
    assert {r["receiver_worker"] for row in sends for r in row.payload["routes"]} == {gen_worker}

    # A new worker for generation rank 0: the senders must not write into its pools while the
    # receive job that checks them is pinned to the old worker.
    restarted = attach_worker(db, "gen", 0, "gen-0-restarted")
    now = utcnow()
    assert claim(db, fleet["workers"][("ctx", 0)], now) is None
    first = [row for row in job_rows(db, transfer_id) if row.attempt == 1]
    failed = next(row for row in first if row.kind == "send" and row.rank == 0)
    assert failed.state == "failed"
    assert failed.error is not None and "receive job was planned" in failed.error
    retry = [row for row in job_rows(db, transfer_id) if row.attempt == 2]
    assert [row.worker_id for row in retry if row.kind == "receive"] == [restarted]

    plain = submit(db, "plain", mode="fragments")  # without verify: nothing to check, no pin
    assert {row.kind for row in job_rows(db, plain)} == {"send"}
    assert all("receiver_worker" not in r for row in job_rows(db, plain)
               for r in row.payload["routes"])


@pytest.mark.parametrize("mode", ["staged", "fragments"])
def test_a_receive_job_pinned_to_a_gone_worker_is_not_stranded(db: Database, mode: str) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    old = fleet["workers"][("gen", 0)]
    transfer_id = submit(db, "r1", mode=mode, verify=True)
    replacement = attach_worker(db, "gen", 0, "gen-0-new")
    with db.write() as session:
        jobs.stop_worker(session=session, worker_id=old)  # before it claimed its receive job
    now = utcnow()
    # Any claim reaps: the pinned job fails and the transfer is retried on the live worker.
    got = claim(db, fleet["workers"][("ctx", 0)], now)
    assert got is None  # the retry waits for its backoff
    first = {row.kind: row for row in job_rows(db, transfer_id) if row.attempt == 1}
    assert first["receive"].state == "failed"
    row = transfer(db, transfer_id)
    assert row.status == "queued" and row.attempt == 2
    assert row.error is not None and f"worker {old}" in row.error and "is gone" in row.error
    retry = [job for job in job_rows(db, transfer_id) if job.attempt == 2]
    assert [job.worker_id for job in retry if job.kind == "receive"] == [replacement]

    # Gone by silence (no heartbeat for WORKER_GONE_S), with no live worker left: failed.
    later = now + timedelta(seconds=jobs.WORKER_GONE_S + 1)
    beat(db, later, fleet["workers"][("ctx", 0)])
    assert claim(db, fleet["workers"][("ctx", 0)], later) is None
    row = transfer(db, transfer_id)
    assert row.status == "failed"
    assert row.error is not None and "retry impossible" in row.error


def test_a_retry_may_reuse_its_own_quarantined_staging_area(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    # a staging buffer that holds exactly one 8-block transfer (1 KiB per block)
    small = attach_worker(db, "gen", 0, "gen.r0.small", staging_bytes=8 << 10)
    transfer_id = submit(db, "r1", blocks=8)
    t0 = utcnow()
    assert claim(db, fleet["workers"][("ctx", 0)], t0) is not None  # then the sender goes quiet
    reaped_at = t0 + TTL + timedelta(seconds=1)
    beat(db, reaped_at, small)
    with db.write() as session:  # alive, but not running the job: its lease is not extended
        jobs.heartbeat(session=session, worker_id=fleet["workers"][("ctx", 0)], now=reaped_at,
                       jobs=[])
        assert jobs.reap_expired(session=session, now=reaped_at) == 1
    # The stale sender writes this transfer's own bytes: its next attempt may take the area.
    row = transfer(db, transfer_id)
    assert row.status == "queued" and row.attempt == 2, row.error
    areas = {(job.attempt, job.staging_offset) for job in job_rows(db, transfer_id)
             if job.kind == "receive"}
    assert areas == {(1, 0), (2, 0)}
    # Another transfer may not: the area is quarantined (and the retry holds it anyway).
    with pytest.raises(Unavailable):
        submit(db, "r2", blocks=8)


def test_heartbeats_extend_only_the_jobs_the_worker_runs(db: Database) -> None:
    # A claim committed whose answer was lost: the client's retry leases a second job, and the
    # first one, unknown to the worker, must expire rather than be kept alive by heartbeats.
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    worker = fleet["workers"][("ctx", 0)]
    lost_transfer = submit(db, "lost", mode="fragments")
    kept_transfer = submit(db, "kept", mode="fragments")
    t0 = utcnow()
    lost = claim(db, worker, t0)
    kept = claim(db, worker, t0)
    assert lost is not None and kept is not None
    for seconds in (10, 20, 30):
        with db.write() as session:
            row = jobs.heartbeat(session=session, worker_id=worker, jobs=[kept[0]],
                                 now=t0 + timedelta(seconds=seconds))
            seen = jobs.worker_read(session, row, t0, jobs=[kept[0]])
        assert seen.current_job == kept[0]
    later = t0 + TTL + timedelta(seconds=1)
    beat(db, later, fleet["workers"][("gen", 0)])
    with db.write() as session:
        assert jobs.reap_expired(session=session, now=later) == 1
    by_id = {row.id: row for tid in (lost_transfer, kept_transfer) for row in job_rows(db, tid)}
    assert by_id[lost[0]].state == "failed" and by_id[kept[0]].state == "leased"
    assert transfer(db, lost_transfer).attempt == 2  # retried
    # Without a list (an older worker), every lease the worker holds is extended.
    with db.write() as session:
        row = jobs.heartbeat(session=session, worker_id=worker, now=later)
        assert jobs.worker_read(session, row, later).current_job == kept[0]


def test_checksum_disagreement_fails_the_transfer(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1", verify=True)
    now = utcnow()
    for key, checksum in ((("ctx", 0), 111), (("gen", 0), 222)):
        job_id, token, kind, payload = claim(db, fleet["workers"][key], now)  # type: ignore[misc]
        complete(db, job_id, token, now,
                 routes=[{"sender_rank": 0, "receiver_rank": 0, "bytes": 1,
                          "checksum": checksum}])
    failed = transfer(db, transfer_id)
    assert failed.status == "failed"
    assert failed.error is not None and failed.error.startswith("checksum_mismatch")


def test_expired_lease_is_retried_and_the_stale_worker_is_fenced(db: Database) -> None:
    setup = setup_fleet(db, ctx_tp=1, gen_tp=1)
    gen_worker = setup["workers"][("gen", 0)]
    transfer_id = submit(db, "r1", mode="fragments")
    t0 = utcnow()
    dying = setup["workers"][("ctx", 0)]
    standby = attach_worker(db, "ctx", 0, "ctx.r0.standby", t0)
    job_id, token, _, _ = claim(db, dying, t0)  # type: ignore[misc]
    # the dying worker stops heartbeating; the others keep beating
    t1 = t0 + TTL + timedelta(seconds=1)
    beat(db, t1, standby, gen_worker)
    assert claim(db, standby, t1) is None  # attempt 2 waits for its backoff
    assert transfer(db, transfer_id).attempt == 2
    t2 = t1 + timedelta(seconds=jobs.RETRY_BACKOFF_S[0] + 0.1)
    beat(db, t2, standby, gen_worker)
    retry = claim(db, standby, t2)
    assert retry is not None and retry[3]["attempt"] == 2
    # the first worker wakes up and reports: its lease is gone, nothing is overwritten
    with pytest.raises(LeaseLost):
        complete(db, job_id, token, t2)
    complete(db, retry[0], retry[1], t2)
    assert transfer(db, transfer_id).status == "done"
    states = sorted((row.attempt, row.state) for row in job_rows(db, transfer_id))
    assert states == [(1, "failed"), (2, "done")]


def test_lease_expiring_on_every_attempt_fails_after_max_attempts(db: Database) -> None:
    setup = setup_fleet(db, ctx_tp=1, gen_tp=1)
    gen_worker = setup["workers"][("gen", 0)]
    worker = setup["workers"][("ctx", 0)]
    transfer_id = submit(db, "r1", mode="fragments")
    now = utcnow()
    for attempt in range(1, 4):
        got = claim(db, worker, now)
        assert got is not None and got[3]["attempt"] == attempt
        # the worker crashes mid-job; a replacement attaches; the lease expires
        now += TTL + timedelta(seconds=10)
        beat(db, now, gen_worker)
        worker = attach_worker(db, "ctx", 0, f"ctx.r0.restart{attempt}", now)
        with db.write() as session:
            assert jobs.reap_expired(session=session, now=now) == 1
        now += timedelta(seconds=max(jobs.RETRY_BACKOFF_S) + 1)
        beat(db, now, gen_worker, worker)
    final = transfer(db, transfer_id)
    assert final.status == "failed"
    assert "lease expired" in (final.error or "")
    assert final.attempt == 3
    assert claim(db, worker, now) is None  # nothing is left to run


def test_dead_worker_without_replacement_fails_the_transfer_clearly(db: Database) -> None:
    setup = setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1", mode="fragments")
    now = utcnow()
    assert claim(db, setup["workers"][("ctx", 0)], now) is not None
    now += TTL + timedelta(seconds=10)
    beat(db, now, setup["workers"][("gen", 0)])
    with db.write() as session:
        jobs.reap_expired(session=session, now=now)
    final = transfer(db, transfer_id)
    assert final.status == "failed"
    assert "no live worker for context rank 0" in (final.error or "")


def test_non_retryable_failure_fails_at_once_with_the_reason(db: Database) -> None:
    setup = setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1", mode="fragments")
    job_id, token, _, _ = claim(db, setup["workers"][("ctx", 0)], utcnow())  # type: ignore[misc]
    with db.write() as session:
        jobs.fail_job(session=session, job_id=job_id,
                      body=JobFail(lease_token=token, reason="NIXL said ERR", retryable=False),
                      now=utcnow())
    failed = transfer(db, transfer_id)
    assert failed.status == "failed" and "NIXL said ERR" in (failed.error or "")
    with db.write() as session:
        retried = jobs.retry_transfer(session=session, transfer_id=transfer_id, now=utcnow())
        assert retried.status == "queued" and retried.attempt == 2


def test_reregistration_mid_transfer_fails_it_and_fences_old_jobs(db: Database) -> None:
    setup = setup_fleet(db, ctx_tp=1, gen_tp=1)
    transfer_id = submit(db, "r1")
    worker = setup["workers"][("ctx", 0)]
    job_id, token, _, _ = claim(db, worker, utcnow())  # type: ignore[misc]
    ctx, _ = fleet_bodies(1, 1)
    ctx["ranks"][0]["pools"][0]["num_slots"] = 32  # the restarted peer has another layout
    with db.write() as session:
        instances.register_instance(session=session, name="ctx",
                                    body=schemas.InstanceCreate.model_validate(ctx))
    failed = transfer(db, transfer_id)
    assert failed.status == "failed" and (failed.error or "").startswith("peer_restarted")
    assert {row.state for row in job_rows(db, transfer_id)} == {"failed"}
    with pytest.raises(LeaseLost):
        complete(db, job_id, token, utcnow())
    # the old worker must attach again (to the new layout) before it may claim
    with pytest.raises(Conflict) as error, db.write() as session:
        jobs.claim_job(session=session, worker_id=worker, now=utcnow())
    assert error.value.code == "worker_stale"


def test_staging_areas_of_concurrent_transfers_never_overlap(db: Database) -> None:
    setup_fleet(db, ctx_tp=1, gen_tp=1)
    # 1 KiB per block (2 layers x K,V x 4 heads x 4 tokens x 8 dims x 2 bytes); the newest live
    # generation worker registered a 20 KiB staging buffer
    attach_worker(db, "gen", 0, "gen.r0.small", staging_bytes=20 << 10)
    first = submit(db, "r1", blocks=8)
    second = submit(db, "r2", blocks=8)
    assert transfer(db, first).bytes == 8 << 10
    areas = sorted(
        (row.staging_offset, row.staging_offset + row.staging_bytes)
        for tid in (first, second) for row in job_rows(db, tid) if row.kind == "receive"
    )
    assert areas == [(0, 8 << 10), (8 << 10, 16 << 10)]
    # a third does not fit beside them: 503 with a retry hint, and nothing is stored
    with pytest.raises(Unavailable) as busy:
        submit(db, "r3", blocks=8)
    assert busy.value.code == "staging_busy" and busy.value.headers["Retry-After"]
    with pytest.raises(BadRequest) as too_big:
        submit(db, "r4", blocks=24)
    assert too_big.value.code == "staging_too_small"
    with db.read() as session:
        assert session.scalar(select(func.count()).select_from(TransferRow)) == 2
    # once the first transfer has failed, its area is released and reused
    sender = next(row for row in job_rows(db, first) if row.kind == "send")
    with db.read() as session:
        ctx_worker = next(w.id for w in jobs.list_workers(session=session, instance="ctx"))
    job_id, token, _, _ = claim(db, ctx_worker, utcnow())  # type: ignore[misc]
    assert job_id == sender.id
    with db.write() as session:
        jobs.fail_job(session=session, job_id=job_id,
                      body=JobFail(lease_token=token, reason="gone", retryable=False),
                      now=utcnow())
    assert transfer(db, first).status == "failed"
    # The failed sender may have left a WRITE in flight: its area stays quarantined until the
    # sender's job has run out of time, then it is reused.
    quarantined = next(row for row in job_rows(db, first) if row.kind == "receive")
    assert quarantined.lease_expires_at is not None
    assert quarantined.lease_expires_at >= utcnow() + timedelta(seconds=jobs.JOB_TIMEOUT_S - 5)
    with pytest.raises(Unavailable) as busy:
        submit(db, "r5", blocks=8)
    assert busy.value.code == "staging_busy"
    with db.write() as session:
        session.get(JobRow, quarantined.id).lease_expires_at = utcnow() - timedelta(seconds=1)
    third = submit(db, "r5", blocks=8)
    area = next(row for row in job_rows(db, third) if row.kind == "receive")
    assert (area.staging_offset, area.staging_bytes) == (0, 8 << 10)


def test_a_sender_whose_lease_expired_keeps_the_receive_area_quarantined(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    first = submit(db, "r1", blocks=4)
    t0 = utcnow()
    assert claim(db, fleet["workers"][("ctx", 0)], t0) is not None  # the sender, then silence
    reaped_at = t0 + TTL + timedelta(seconds=1)
    beat(db, reaped_at, fleet["workers"][("gen", 0)])
    with db.write() as session:
        assert jobs.reap_expired(session=session, now=reaped_at) == 1
    area = next(row for row in job_rows(db, first) if row.kind == "receive" and row.attempt == 1)
    assert area.state == "failed"
    # The expired sender may still be writing until its job's time is up.
    assert area.lease_expires_at is not None
    assert area.lease_expires_at >= reaped_at + timedelta(seconds=jobs.JOB_TIMEOUT_S)


def test_worker_pools_must_match_the_registered_rank(db: Database) -> None:
    setup_fleet(db, ctx_tp=1, gen_tp=1)
    with db.write() as session:
        row = instances.get_instance(session=session, name="ctx")
        body = row.ranks[0].body
    from api.demo import fake_peer
    from api.schemas_exec import WorkerCreate

    peer = fake_peer(body, "ctx.r0.bad")
    peer["pools"][0]["slot_bytes"] += 1
    with pytest.raises(Conflict) as error, db.write() as session:
        jobs.register_worker(
            session=session,
            body=WorkerCreate.model_validate({"instance": "ctx", "rank": 0, "peer": peer}),
            now=utcnow(),
        )
    assert error.value.code == "pool_mismatch"
