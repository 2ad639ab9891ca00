"""Push channel to workers and completion events for waiters (in process, no polling).

- :class:`CommandHub`: every worker holds ``GET /v1/workers/{id}/commands`` open (a newline-
  delimited JSON stream). ``POST /v1/transfers`` with ``execute=true`` pushes one command per rank
  taking part into the streams of those ranks' workers; a worker starts its side of the transfer
  the moment the line arrives. Routes run in the thread pool, so :meth:`CommandHub.push` hands
  the message to the event loop thread-safely.
- :class:`Completions`: ``GET /v1/transfers/{id}?wait=S`` waits on an event that the records
  route sets when it settles that transfer: it wakes on completion, not on a timer.

Both live in one API process. With several processes on one PostgreSQL database a worker's stream
and a router's request may reach different processes: the push then goes through the database's
``LISTEN``/``NOTIFY`` (:class:`PostgresRelay`), and so does the news that a batch of records
settled transfers, which wakes their waiters on every process (a waiter also re-reads the
transfer once a second, in case a notification was missed).

When an API process dies, or a worker's stream moves to another process, a command can be lost
on the way: pushed into a stream that is gone, relayed while the worker held no stream anywhere,
or committed by a process that died before it pushed. Delivery is therefore *at least once*:

- a stream that dropped here moments ago (the reconnect grace) may come back here or open on
  another process: its commands are queued here **and** relayed;
- a stream that opens re-sends what the database says its worker still owes: the commands of
  running transfers for its rank that have no recorded part yet
  (``services/execution.py``, :func:`~api.services.execution.commands_owed`);
- an ``Idempotency-Key`` replay of a running transfer re-sends them too (the client retries
  through another process when the first one died before answering).

Workers drop a command whose ``xid`` and side they have already seen, so a duplicate is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0
RECONNECT_GRACE_S = 10.0  # commands for a worker whose stream dropped (or is not open yet) wait
QUEUE_LIMIT = 10_000  # commands buffered for one slow stream before it is cut off
NOTIFY_CHANNEL = "kvplane_dispatch"
SETTLED_PER_NOTIFY = 150  # transfer ids per "settled" notification (33 bytes each; 8000 max)


class CommandHub:
    """The command streams held open to this process, by worker id."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        # A stream that dropped keeps its queue a little while: the worker reconnects within
        # seconds and finds the commands pushed meanwhile.
        self._dropped: dict[str, float] = {}
        self._lock = threading.Lock()
        self.relay: PostgresRelay | None = None
        self.origin = uuid.uuid4().hex  # names this process on the relay

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def connect(self, worker_id: str) -> asyncio.Queue[dict[str, Any] | None]:
        """The stream's queue for ``worker_id`` (an older live stream of it is closed)."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            queue = self._streams.get(worker_id)
            if queue is not None and worker_id not in self._dropped:
                fresh: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(QUEUE_LIMIT)
                while not queue.empty():  # keep what the older stream had not sent yet ...
                    item = queue.get_nowait()
                    if item is not None:
                        fresh.put_nowait(item)
                queue.put_nowait(None)  # ... then close it
                queue = fresh
            elif queue is None:
                queue = asyncio.Queue(QUEUE_LIMIT)
            self._streams[worker_id] = queue
            self._dropped.pop(worker_id, None)
        return queue

    def disconnect(self, worker_id: str, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        with self._lock:
            if self._streams.get(worker_id) is queue:
                self._dropped[worker_id] = time.monotonic()
            cutoff = time.monotonic() - RECONNECT_GRACE_S
            for gone in [w for w, t in self._dropped.items() if t < cutoff]:
                del self._dropped[gone]
                self._streams.pop(gone, None)

    def connected(self, worker_id: str) -> bool:
        """Whether ``worker_id`` holds a stream here (or dropped it moments ago, or commands
        wait here for its first stream)."""
        dropped = self._dropped.get(worker_id)
        return worker_id in self._streams and (
            dropped is None or time.monotonic() - dropped < RECONNECT_GRACE_S)

    def push(self, commands: Iterable[tuple[str, dict[str, Any]]]) -> list[str]:
        """Deliver ``(worker_id, message)`` pairs; returns the worker ids not connected here
        (relayed through the database when one is configured)."""
        local: list[tuple[str, dict[str, Any]]] = []
        remote: list[tuple[str, dict[str, Any]]] = []
        for worker_id, message in commands:
            if self.connected(worker_id):
                local.append((worker_id, message))
                if self.relay is not None and worker_id in self._dropped:
                    # Its stream dropped moments ago: it may come back here, or it may be
                    # reconnecting to another API process (this one's peer died, or a load
                    # balancer moved it). Both get the command; the worker drops the second.
                    remote.append((worker_id, message))
            else:
                remote.append((worker_id, message))
        if local and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, local)
        if remote and self.relay is not None:
            self.relay.publish(remote)
            return []
        if remote and self._loop is not None:
            # A worker attached moments ago may not have opened its stream yet: its commands
            # wait for it as for a stream that just dropped.
            self._loop.call_soon_threadsafe(self._hold, remote)
        return [worker_id for worker_id, _ in remote]

    def _hold(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        now = time.monotonic()
        with self._lock:
            for worker_id, _ in messages:
                dropped = self._dropped.get(worker_id)
                if worker_id not in self._streams or (
                        dropped is not None and now - dropped >= RECONNECT_GRACE_S):
                    self._streams[worker_id] = asyncio.Queue(QUEUE_LIMIT)
                    self._dropped[worker_id] = now
        self._deliver(messages)

    def _deliver(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        for worker_id, message in messages:
            queue = self._streams.get(worker_id)
            if queue is None:
                log.warning("worker %s disconnected before its command arrived", worker_id)
                continue
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:
                log.warning("worker %s is not reading its commands; closing its stream",
                            worker_id)
                self._streams.pop(worker_id, None)
                while not queue.empty():  # its transfers fail at their deadlines
                    queue.get_nowait()
                queue.put_nowait(None)  # the stream ends; the worker reconnects

    def deliver_now(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        """Deliver into streams held here (call on the event loop)."""
        if messages:
            self._deliver(messages)

    def deliver_threadsafe(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, messages)


class Completions:
    """Per-transfer events that waiters sleep on; set when a transfer settles."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, tuple[asyncio.Event, int]] = {}

    def event(self, transfer_id: str) -> asyncio.Event:
        """The event of ``transfer_id`` (call on the event loop; :meth:`release` after)."""
        self._loop = asyncio.get_running_loop()
        found = self._events.get(transfer_id)
        event = asyncio.Event() if found is None else found[0]
        self._events[transfer_id] = (event, (0 if found is None else found[1]) + 1)
        return event

    def release(self, transfer_id: str) -> None:
        found = self._events.get(transfer_id)
        if found is None:
            return
        if found[1] <= 1:
            del self._events[transfer_id]
        else:
            self._events[transfer_id] = (found[0], found[1] - 1)

    def settled(self, transfer_ids: Iterable[str]) -> None:
        """Wake the waiters of ``transfer_ids`` (thread-safe)."""
        ids = list(transfer_ids)
        if ids and self._loop is not None:
            self._loop.call_soon_threadsafe(self._set, ids)

    def _set(self, ids: list[str]) -> None:
        for transfer_id in ids:
            found = self._events.get(transfer_id)
            if found is not None:
                found[0].set()


class PostgresRelay:
    """Commands for workers connected to another API process, through ``LISTEN``/``NOTIFY``.

    A notification carries ``worker_id`` and the command (a few hundred bytes; PostgreSQL allows
    8000). Every process listens on one connection in a thread and delivers the commands of the
    workers whose streams it holds. It publishes on a second connection that it keeps open
    (connecting per push cost about 16 ms on loopback; a ``NOTIFY`` on a held one 0.2 ms).
    """

    def __init__(self, url: str, hub: CommandHub,
                 completions: Completions | None = None) -> None:
        self.url = url
        self.hub = hub
        self.completions = completions
        self._publisher: Any = None  # the held publishing connection, under _publish_lock
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self.listening = threading.Event()  # LISTEN is active: notifications reach this process
        self._thread = threading.Thread(target=self._listen, daemon=True,
                                        name="kvplane-relay")
        self._thread.start()

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(self.url, autocommit=True)

    def publish(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        payloads = []
        for worker_id, message in messages:
            payload = json.dumps({"worker_id": worker_id, "message": message,
                                  "origin": self.hub.origin}, separators=(",", ":"))
            if len(payload) > 7900:
                log.warning("command for worker %s too large to relay (%d bytes)", worker_id,
                            len(payload))
                continue
            payloads.append(payload)
        self._notify(payloads)

    def publish_settled(self, transfer_ids: list[str]) -> None:
        """Tell the other processes that these transfers settled (their waiters wake)."""
        self._notify([
            json.dumps({"settled": transfer_ids[i:i + SETTLED_PER_NOTIFY],
                        "origin": self.hub.origin}, separators=(",", ":"))
            for i in range(0, len(transfer_ids), SETTLED_PER_NOTIFY)])

    def _notify(self, payloads: list[str]) -> None:
        if not payloads:
            return
        with self._publish_lock:
            # Twice at most: a held connection may have died since the last push (a database
            # restart). A notification sent twice is harmless (workers drop repeats).
            for attempt in range(2):
                try:
                    if self._publisher is None or self._publisher.closed:
                        self._publisher = self._connect()
                    for payload in payloads:
                        self._publisher.execute("SELECT pg_notify(%s, %s)",
                                                (NOTIFY_CHANNEL, payload))
                    return
                except Exception as error:
                    self._drop_publisher()
                    if attempt:
                        log.warning("relaying %d notification(s) failed: %s", len(payloads),
                                    error)

    def _drop_publisher(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            with contextlib.suppress(Exception):  # it is broken already
                publisher.close()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                with self._connect() as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self.listening.set()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            data = json.loads(note.payload)
                            if data.get("origin") == self.hub.origin:
                                continue  # our own push: delivered here already if it could
                            if "settled" in data:
                                if self.completions is not None:
                                    self.completions.settled(data["settled"])
                            elif self.hub.connected(data["worker_id"]):
                                self.hub.deliver_threadsafe(
                                    [(data["worker_id"], data["message"])])
            except Exception as error:
                if self._stop.is_set():
                    return
                log.warning("dispatch relay: %s; reconnecting", error)
                self._stop.wait(1.0)

    def close(self) -> None:
        self._stop.set()
        with self._publish_lock:
            self._drop_publisher()
        # The listener sees the stop within a second (its notification timeout) and ends
        # without another connection attempt.
