"""Workers' records of finished transfer parts, written together: one transaction per group.

Records reach an API process over the workers' streams (``/v1/workers/{id}/stream``) and over
``POST /v1/transfers/records``. Each batch is handed to this process's :class:`RecordWriter`,
whose thread takes every batch that arrived while it wrote the previous group and writes them
in one transaction, each batch under a savepoint of its own: a batch refused for what it says
(a 4xx) is rolled back alone and answered with its error, the others commit. The transfers the
group settles are settled in that transaction too, and their waiters (``?wait=``) wake once it
commits, on this process and, through the relay's NOTIFY sent in that transaction, on the
others.

A transfer's ranks report within a millisecond or two of each other, so under load a group
holds several ranks' and several transfers' parts, and a transfer costs the control plane one
commit instead of one per rank. A lone batch waits :data:`LINGER_S` (2 ms) for others, no more.

When a group's transaction fails as a whole (a deadlock with another API process's group over
the same transfers on PostgreSQL, or a lost connection), each of its batches is written again
alone, in a transaction of its own, as it would have been without grouping.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from api import schemas_exec as wire
from api.db import Database
from api.dispatch import Completions
from api.errors import KvplaneError
from api.metrics import Metrics
from api.models import TransferRow
from api.services import execution, stats, transfers

log = logging.getLogger(__name__)

# A lone batch waits this long for others before its group is written: a transfer's receivers
# report within a millisecond or two of each other. Alternating bench/latency.py runs (REST, 4
# blocks, 2026-12-07): 8 in flight 64-65 ms p50 and 112-117 transfers/s with it, 68-70 ms and
# 106-112 without; 1 in flight within the noise; 5 ms was worse.
LINGER_S = 0.002


@dataclass
class _Batch:
    body: wire.TransferRecords
    done: concurrent.futures.Future[wire.RecordsAccepted] = field(
        default_factory=concurrent.futures.Future
    )


@dataclass
class _Outcome:
    """What one batch's savepoint gave: an answer or an error, and the transfers it settled."""

    batch: _Batch
    answer: wire.RecordsAccepted | None = None
    error: Exception | None = None
    settled: list[str] = field(default_factory=list)
    stored: list[wire.TransferRecord] = field(default_factory=list)


class RecordWriter:
    """Group commit of record batches on one thread (see the module)."""

    def __init__(
        self,
        db: Callable[[], Database],
        clock: Callable[[], datetime],
        completions: Completions,
        metrics: Metrics,
        relay: Callable[[], Any],
    ) -> None:
        self.db = db  # the app's database and clock, read per group (tests swap them)
        self.clock = clock
        self.completions = completions
        self.metrics = metrics
        self.relay = relay  # the process's PostgresRelay, when it has one (read per group)
        self.groups = 0  # transactions written
        self.batches = 0  # batches answered
        self._queue: list[_Batch] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def submit(self, body: wire.TransferRecords) -> concurrent.futures.Future[wire.RecordsAccepted]:
        """Queue one batch; the future answers it (or raises its error) once its group commits."""
        batch = _Batch(body)
        with self._cond:
            self._queue.append(batch)
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(
                    target=self._loop, daemon=True, name="kvplane-record-writer"
                )
                self._thread.start()
            self._cond.notify()
        return batch.done

    def record(self, body: wire.TransferRecords) -> wire.RecordsAccepted:
        """Write one batch with whatever else arrives meanwhile; its answer or its error."""
        return self.submit(body).result()

    def close(self) -> None:
        """Write what is queued, then stop the thread (a later batch starts another)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=10)

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._queue and not self._stopping and self._thread is me:
                    self._cond.wait()
                if len(self._queue) == 1 and LINGER_S > 0 and not self._stopping:
                    self._cond.wait(LINGER_S)  # a lone batch: its peers' are often a moment away
                group, self._queue = self._queue, []
            if not group:
                return  # stopped (or replaced by a newer thread) with nothing left
            try:
                self._write(group)
            except Exception as error:  # never lose the thread; the group's callers get it
                log.exception("writing %d record batch(es) failed", len(group))
                for batch in group:
                    if not batch.done.done():
                        batch.done.set_exception(error)

    def _write(self, group: list[_Batch]) -> None:
        now = self.clock()
        try:
            outcomes, finished, reads = self._together(group, now)
        except SQLAlchemyError as error:
            if len(group) == 1:
                group[0].done.set_exception(error)
                return
            log.info("a group of %d record batches failed (%s); each alone", len(group), error)
            for batch in group:
                self._write([batch])
            return
        self.groups += 1
        settled = sorted({tid for outcome in outcomes for tid in outcome.settled})
        self.completions.settled(settled, reads)
        for outcome in outcomes:
            self.metrics.record_batches.inc()
            for record in outcome.stored:  # repeats and other attempts' records: not counted
                self.metrics.part_results.labels(state=record.status).inc()
                self.metrics.moved_bytes.labels(kind=record.side).inc(record.bytes)
        self.metrics.transfers_settled(finished)
        for outcome in outcomes:
            self.batches += 1
            if outcome.error is not None:
                outcome.batch.done.set_exception(outcome.error)
            else:
                assert outcome.answer is not None
                outcome.batch.done.set_result(outcome.answer)

    def _together(
        self, group: list[_Batch], now: datetime
    ) -> tuple[list[_Outcome], Any, dict[str, Any]]:
        """One transaction: each batch under its savepoint, then the settled transfers' stats,
        and those of them that somebody here waits for as they are now (their waiters answer
        with that, and read nothing)."""
        outcomes: list[_Outcome] = []
        with self.db().write() as session:
            for batch in group:
                outcome = _Outcome(batch)
                try:
                    with session.begin_nested():
                        accepted, settled = execution.record_parts(
                            session=session, body=batch.body, now=now, stored=outcome.stored
                        )
                except execution.UnexpandableBlocks as error:
                    # Refused whole; a transfer the other side's records already opened fails
                    # now, with the reason, instead of waiting for a part never to be stored.
                    outcome.stored.clear()
                    outcome.error = error
                    outcome.settled = execution.fail_transfers(
                        session=session,
                        transfer_ids=[error.extra["transfer_id"]],
                        now=now,
                        reason=error.detail,
                    )
                except KvplaneError as error:  # refused for what it says: this batch alone
                    outcome.stored.clear()
                    outcome.error = error
                else:
                    outcome.answer = wire.RecordsAccepted(accepted=accepted, settled=settled)
                    outcome.settled = settled
                outcomes.append(outcome)
            ids = sorted({tid for outcome in outcomes for tid in outcome.settled})
            finished = stats.finished(session=session, transfer_ids=ids)
            waited = set(self.completions.waited()).intersection(ids)
            reads = {}
            for tid in sorted(waited):  # as the settle wrote them, not as a savepoint read them
                row = session.get(TransferRow, tid, populate_existing=True)
                if row is not None:
                    reads[tid] = transfers.transfer_read(row)
            relay = self.relay()
            if ids and relay is not None:  # waiters on the other API processes wake at commit
                relay.notify_in(session, relay.settled_payloads(ids))
        return outcomes, finished, reads
