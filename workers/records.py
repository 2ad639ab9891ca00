"""The record of finished transfers follows the hot path asynchronously, in batches.

A worker's :class:`Recorder` collects one record per finished handle and sends them over the
worker's two-way stream (``/v1/workers/{id}/stream``) while it is open, else posts them to
``POST /v1/transfers/records``; a batch the stream cannot deliver (it dropped, or no answer came
in :data:`STREAM_ANSWER_S`) is posted instead. One batch per ``batch`` records or per
``interval_s``, whichever comes first, and at once for a record somebody waits for (a
REST-dispatched transfer, whose ``GET ?wait=`` long-poll wakes when it settles). Sending happens
on its own thread: recording never blocks a transfer, nor holds the GIL for long (a batch is
encoded record by record, with brief sleeps between slices: ``json.dumps`` of a whole batch is
one C call, and every other thread of the rank, the progress thread included, waits until it
returns). While the control plane is unreachable records stay queued (at most ``max_pending``;
the oldest are dropped beyond that, and counted) and are retried with backoff, so the record
catches up when it returns. A repeated record is ignored by the control plane, so a batch whose
answer was lost is simply sent again. A batch refused with a 4xx (other than 401, 408 and 429)
is split record by record and each refused record is dropped and logged: retrying it cannot
succeed, and at the head of the queue it would hold back every later record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from api.client import ApiError, Client, TransportError, WorkerStream

log = logging.getLogger("kvplane.records")

BATCH = 256
INTERVAL_S = 1.0
MAX_PENDING = 100_000
MAX_BACKOFF_S = 10.0
STREAM_ANSWER_S = 10.0  # a batch sent over the stream and not answered by then is posted
_TRANSIENT = (401, 408, 429)  # 4xx worth retrying: a token being rotated, a timeout, a limit


def _refused(status: int) -> bool:
    """Whether the control plane refused a batch for what it says (retrying the same records
    cannot succeed: they are dropped and logged, else one bad record would wedge the queue)."""
    return 400 <= status < 500 and status not in _TRANSIENT


class Recorder:
    """Batches records and posts them from a background thread."""

    def __init__(
        self,
        client: Client,
        worker_id: Callable[[], str | None],
        *,
        batch: int = BATCH,
        interval_s: float = INTERVAL_S,
        max_pending: int = MAX_PENDING,
        stream: Callable[[], WorkerStream | None] | None = None,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.stream = stream  # the worker's open two-way stream, if any (read per batch)
        self.batch = batch
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.posted = 0
        self.dropped = 0
        self.refused = 0  # records the control plane refused with a 4xx, dropped
        self.failures = 0
        self.streamed = 0  # records answered over the stream
        self.stream_fallbacks = 0  # batches the stream could not deliver, posted instead
        self._pending: deque[dict[str, Any]] = deque()
        self._urgent = False
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kvplane-records")
        self._thread.start()

    def add(self, record: Mapping[str, Any], *, urgent: bool = False) -> None:
        """Queue one record; ``urgent``: post now (somebody is waiting for it)."""
        with self._cond:
            self._pending.append(dict(record))
            while len(self._pending) > self.max_pending:
                self._pending.popleft()
                self.dropped += 1
            if urgent:
                self._urgent = True
            # The first record of an empty queue wakes the loop too: it sleeps without a
            # timeout while nothing is queued, and must start the interval's clock.
            if urgent or len(self._pending) >= self.batch or len(self._pending) == 1:
                self._cond.notify()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Post everything queued now; True when nothing is left within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._urgent = True
            self._cond.notify()
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush (bounded) and stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=2.0)
        if self._pending:
            log.warning(
                "%d transfer record(s) not delivered: the control plane was unreachable",
                len(self._pending),
            )

    def _loop(self) -> None:
        delay = 0.0  # current backoff after failed posts
        hold_until = 0.0
        last_post = time.monotonic()
        while True:
            with self._cond:
                while not self._stop:
                    now = time.monotonic()
                    if hold_until > now:
                        self._cond.wait(hold_until - now)
                        continue
                    due = last_post + self.interval_s - now
                    if self._pending and (
                        self._urgent or len(self._pending) >= self.batch or due <= 0
                    ):
                        break
                    self._cond.wait(due if self._pending else None)
                if self._stop:
                    return
                self._urgent = False
                batch = [self._pending[i] for i in range(min(len(self._pending), 1000))]
            worker_id = self.worker_id()
            last_post = time.monotonic()
            if worker_id is None:
                hold_until = last_post + 1.0
                continue
            try:
                done = self._post(worker_id, batch)
            except ApiError as error:
                self.failures += 1
                delay = min(MAX_BACKOFF_S, max(0.5, delay * 2))
                hold_until = time.monotonic() + delay
                log.warning(
                    "recording %d transfer(s) failed (%s); retrying in %.1f s",
                    len(batch),
                    error,
                    delay,
                )
                continue
            delay = 0.0
            with self._cond:
                for _ in range(done):
                    if self._pending:
                        self._pending.popleft()

    def _post(self, worker_id: str, batch: list[dict[str, Any]]) -> int:
        """Post ``batch``; returns how many of its records are settled (posted or refused for
        good). A batch the control plane refuses is split, so that one bad record (a bug, or a
        worker the control plane no longer knows) does not take the good ones with it."""
        try:
            self._send(worker_id, batch)
        except ApiError as error:
            if not _refused(error.status):
                raise
            self.failures += 1
            if len(batch) == 1:
                self.refused += 1
                log.warning("control plane refused a record (dropped): %s", error)
                return 1
            done = 0
            for record in batch:
                done += self._post(worker_id, [record])
            return done
        self.posted += len(batch)
        return len(batch)

    def _send(self, worker_id: str, batch: list[dict[str, Any]]) -> None:
        """Over the stream when it is open (a refusal raises as from the route), else posted."""
        stream = self.stream() if self.stream is not None else None
        if stream is not None:
            try:
                stream.record(worker_id, batch, STREAM_ANSWER_S)
                self.streamed += len(batch)
                return
            except TransportError as error:  # a repeated record is ignored: post it
                self.stream_fallbacks += 1
                log.debug("record batch not answered on the stream (%s); posting it", error)
        self.client.record_transfers(worker_id, batch)
