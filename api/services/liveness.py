"""A worker's heartbeat between liveness windows: answered from memory, not the database.

A live worker heartbeats every second, and most of those heartbeats change nothing that anyone
reads: a worker is "gone" only after ``WORKER_GONE_S`` (10 s) without one. So the heartbeat
route writes ``heartbeat_at`` (one small UPDATE) at most once per :data:`WRITE_WINDOW_S` per
worker, and answers the heartbeats in between with what the last write answered, kept here.

What the answer carries (the worker's status and its directory revision) changes only through
:func:`api.services.pairings.bump_directories`, which every such write calls (an attach that
supersedes a worker, a stop, an instance's new epoch or deletion, a pairing, a worker back from
"gone"). That call forgets every kept answer, once when it runs and once more after its
transaction commits, so a heartbeat whose database read raced the change does not keep the
old answer. A change made through another API process (several behind one PostgreSQL database)
reaches a worker's heartbeat answer within :data:`WRITE_WINDOW_S`.
"""

from __future__ import annotations

import threading
from datetime import datetime

from sqlalchemy import event
from sqlalchemy.orm import Session

from api import schemas_exec as wire

WRITE_WINDOW_S = 2.0  # heartbeat_at is written at least this often while a worker heartbeats


class HeartbeatMemo:
    """The last written heartbeat answer per worker, valid for ``window_s`` of the app's clock
    and until something forgets it."""

    def __init__(self, window_s: float = WRITE_WINDOW_S) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[datetime, int, wire.WorkerRead]] = {}
        self._generation = 0

    def answer(self, worker_id: str, now: datetime) -> wire.WorkerRead | None:
        """The answer kept for ``worker_id`` when its last write is under ``window_s`` old."""
        kept = self._answers.get(worker_id)
        if kept is None:
            return None
        written, generation, read = kept
        if generation != self._generation or not 0 <= (now - written).total_seconds() < (
            self.window_s
        ):
            return None
        return read

    def generation(self) -> int:
        """Taken before a heartbeat's database read; :meth:`keep` needs it unchanged."""
        return self._generation

    def keep(
        self, worker_id: str, written: datetime, read: wire.WorkerRead, generation: int
    ) -> None:
        """Keep a heartbeat's answer, unless something was forgotten since its read began."""
        with self._lock:
            if generation == self._generation and read.status == "alive":
                self._answers[worker_id] = (written, generation, read)

    def forget(self) -> None:
        with self._lock:
            self._generation += 1
            self._answers.clear()

    def forget_with(self, session: Session) -> None:
        """Forget now and again once ``session``'s transaction commits."""
        self.forget()
        event.listen(session, "after_commit", lambda _session: self.forget(), once=True)


MEMO = HeartbeatMemo()
