"""Push channel to workers and completion events for waiters (in process, no polling).

- :class:`CommandHub`: every worker holds ``GET /v1/workers/{id}/commands`` open (a newline-
  delimited JSON stream). ``POST /v1/transfers`` with ``execute=true`` pushes one command per rank
  taking part into the streams of those ranks' workers; a worker starts its side of the transfer
  the moment the line arrives. Routes run in the thread pool, so :meth:`CommandHub.push` encodes
  the command there and hands the line to the event loop thread-safely.
- :class:`Completions`: ``GET /v1/transfers/{id}?wait=S`` waits on an event that the records
  route sets when it settles that transfer: it wakes on completion, not on a timer.

Both live in one API process. With several processes on one PostgreSQL database a worker's stream
and a router's request may reach different processes: the push then goes through the database's
``LISTEN``/``NOTIFY`` (:class:`PostgresRelay`), and so does the news that a batch of records
settled transfers, which wakes their waiters on every process. A notification carries a
*reference* to a command (worker, transfer, attempt, side, rank), never the command itself: the
process that holds the worker's stream builds it from the database (as the owed re-send does), so
a command of any size crosses (NOTIFY carries 8,000 bytes at most). A push the relay cannot
publish is an error the caller reports (``503``), never a silent drop.

Memory is bounded in bytes: a command is queued as its encoded line, a worker's queue holds at
most :data:`STREAM_BYTES_MAX` and all queues together :data:`HUB_BYTES_MAX`; past either, the
worker's stream is cut (its transfers' commands are owed again when it reconnects, while their
deadlines last). A stream whose write has not completed within :data:`WRITE_TIMEOUT_S` (a worker
that does not read) is cut too, and shows disconnected at once.

Deadlines are absolute: a command carries its attempt's ``deadline_at`` (Unix seconds), and its
``timeout_s`` is written when the line leaves, as what is left of that deadline then. A command
that waited in a queue does not run past the control plane's deadline; one whose deadline passed
before it left is not sent (its transfer fails at the deadline anyway).

When an API process dies, or a worker's stream moves to another process, a command can be lost
on the way: pushed into a stream that is gone, relayed while the worker held no stream anywhere,
or committed by a process that died before it pushed. Delivery is therefore *at least once*:

- a stream that dropped here moments ago (the reconnect grace) may come back here or open on
  another process: its commands are queued here **and** relayed;
- a stream that opens re-sends what the database says its worker still owes: the commands of
  running transfers for its rank that have no recorded part yet
  (``services/execution.py``, :func:`~api.services.execution.commands_owed`);
- an ``Idempotency-Key`` replay of a running transfer pushes them too (the client retries
  through another process when the first one died before answering).

A stream never carries one command (``xid`` and side) twice while it stays connected: a replay,
a relayed copy or an owed re-send of a command already queued or sent on it adds nothing.
Workers also drop a command whose ``xid`` and side they have already seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0
RECONNECT_GRACE_S = 10.0  # commands for a worker whose stream dropped (or is not open yet) wait
STREAM_BYTES_MAX = 32 << 20  # encoded commands queued for one worker before its stream is cut
HUB_BYTES_MAX = 256 << 20  # ... and for every worker of this process together
WRITE_TIMEOUT_S = 5.0  # a stream write that takes longer: the worker is not reading; cut
CHUNK_BYTES = 1 << 20  # lines written at once, at most (the write timeout is per chunk)
SENT_KEYS = 10_000  # commands remembered per stream to drop a repeat
MIN_LEFT_S = 0.05  # a command with less of its deadline left is not sent
NOTIFY_CHANNEL = "kvplane_dispatch"
REFS_PER_NOTIFY = 40  # command references per notification (~150 bytes each; 8000 max)
SETTLED_PER_NOTIFY = 150  # transfer ids per "settled" notification (33 bytes each; 8000 max)

HELLO = b'{"type":"hello"}\n'
PING = b'{"type":"ping"}\n'


class RelayError(RuntimeError):
    """The relay could not publish: another API process's worker will not get its command."""


@dataclass(slots=True)
class Line:
    """One encoded command: its JSON object without ``timeout_s`` (written per send)."""

    body: bytes
    deadline_s: float | None = None  # Unix seconds; None: no deadline (a control line)
    key: tuple[str, str] | None = None  # (xid, side): a stream carries it once

    @property
    def nbytes(self) -> int:
        return len(self.body) + 24


def encode(message: dict[str, Any]) -> Line:
    """The line of ``message`` (a command dict as :mod:`api.services.execution` builds it)."""
    deadline = message.get("deadline_at")
    body = json.dumps(
        {k: v for k, v in message.items() if k != "timeout_s"}, separators=(",", ":")
    ).encode()
    key = (str(message["xid"]), str(message["side"])) if message.get("type") == "transfer" else None
    return Line(body, None if deadline is None else float(deadline), key)


def render(lines: Iterable[Line], now_s: float) -> list[bytes]:
    """The chunks to write for ``lines`` at Unix time ``now_s`` (``timeout_s`` = what is left of
    each deadline; a line past its deadline is left out), each at most about
    :data:`CHUNK_BYTES`."""
    chunks: list[bytes] = []
    parts: list[bytes] = []
    size = 0
    for line in lines:
        if line.deadline_s is None:
            text = line.body + b"\n"
        else:
            left = line.deadline_s - now_s
            if left < MIN_LEFT_S:
                log.info("a command left after its deadline; not sent (%s)", line.key)
                continue
            text = line.body[:-1] + b',"timeout_s":%.3f}\n' % left
        parts.append(text)
        size += len(text)
        if size >= CHUNK_BYTES:
            chunks.append(b"".join(parts))
            parts, size = [], 0
    if parts:
        chunks.append(b"".join(parts))
    return chunks


@dataclass(eq=False)
class _Stream:
    """One worker's queue here: lines waiting for its open stream (or for one to open)."""

    lines: deque[Line] = field(default_factory=deque)
    nbytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    open: bool = False  # a connection serves it now
    since: float = field(default_factory=time.monotonic)  # dropped (or created) then
    generation: int = 0  # of the connection that serves it; a newer one replaces it
    keys: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)
    final: bytes | None = None  # a last line, then the stream ends (the worker was stopped)
    repeats: int = 0  # commands dropped because this stream carried them already


@dataclass(frozen=True, eq=False)
class Ticket:
    """One connection's claim on its worker's stream."""

    worker_id: str
    stream: _Stream
    generation: int


class CommandHub:
    """The command streams held open to this process, by worker id."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.nbytes = 0  # queued here, every worker together
        self.cuts = 0  # streams cut (a stalled write, or a queue over its bytes)
        self.relay: PostgresRelay | None = None
        self.origin = uuid.uuid4().hex  # names this process on the relay

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # --- connections (event loop) --------------------------------------------------------

    def connect(self, worker_id: str) -> Ticket:
        """Claim ``worker_id``'s stream for a new connection (an older one of it ends; lines
        queued for it stay, and are the only ones it remembers having carried)."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            stream = self._live(worker_id)
            if stream is None:
                stream = self._streams[worker_id] = _Stream()
            stream.generation += 1
            stream.open = True
            stream.final = None
            stream.keys = OrderedDict(
                (line.key, None) for line in stream.lines if line.key is not None
            )
            stream.wake.set()  # an older connection of it wakes and ends
            return Ticket(worker_id, stream, stream.generation)

    async def next_lines(
        self, ticket: Ticket, timeout_s: float
    ) -> tuple[list[Line], bytes | None, bool]:
        """``(lines, final line, ended)`` for ``ticket``'s connection: what is queued, waiting
        up to ``timeout_s`` for something; ``ended``: the connection must end now."""
        stream = ticket.stream
        if not self._current(ticket):
            return [], None, True
        if not stream.lines and stream.final is None:
            stream.wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):  # no Task per wait (wait_for)
                    await stream.wake.wait()
            if not self._current(ticket):
                return [], None, True
        with self._lock:
            lines = list(stream.lines)
            stream.lines.clear()
            self.nbytes -= stream.nbytes
            stream.nbytes = 0
        return lines, stream.final, stream.final is not None

    def disconnect(self, ticket: Ticket) -> None:
        """The connection ended. Its queue waits :data:`RECONNECT_GRACE_S` for the worker to
        reconnect (unless the worker was stopped, or its stream was cut)."""
        with self._lock:
            stream = ticket.stream
            if self._current(ticket):
                stream.open = False
                stream.since = time.monotonic()
                if stream.final is not None:
                    self._drop(ticket.worker_id)
            self._prune()

    def cut(self, ticket: Ticket | None, why: str) -> None:
        """End ``ticket``'s connection now and drop what is queued for it: the worker shows
        disconnected at once; what it is owed is sent again when it reconnects."""
        if ticket is None:
            return
        with self._lock:
            if not self._current(ticket):
                return
            self._drop(ticket.worker_id)
        self.cuts += 1
        log.warning("worker %s: command stream cut (%s)", ticket.worker_id, why)

    def close(self, worker_id: str, message: dict[str, Any]) -> None:
        """Send ``message`` as the last line of ``worker_id``'s stream here, then end it (the
        worker was stopped or superseded); thread-safe. Relayed to the other processes."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._close, worker_id, message)
        if self.relay is not None:
            self.relay.publish_close(worker_id, message)

    def _close(self, worker_id: str, message: dict[str, Any]) -> None:
        with self._lock:
            stream = self._streams.get(worker_id)
            if stream is None:
                return
            if not stream.open:
                self._drop(worker_id)
                return
            self.nbytes -= stream.nbytes
            stream.lines.clear()
            stream.nbytes = 0
            stream.final = json.dumps(message, separators=(",", ":")).encode() + b"\n"
            stream.wake.set()

    def _current(self, ticket: Ticket) -> bool:
        return (
            self._streams.get(ticket.worker_id) is ticket.stream
            and ticket.stream.generation == ticket.generation
        )

    def _drop(self, worker_id: str) -> None:
        """Forget ``worker_id``'s stream and its queue (under the lock)."""
        stream = self._streams.pop(worker_id, None)
        if stream is not None:
            self.nbytes -= stream.nbytes
            stream.lines.clear()
            stream.nbytes = 0
            stream.generation += 1  # its connection, if any, ends at its next line
            stream.wake.set()

    def _live(self, worker_id: str) -> _Stream | None:
        """The worker's stream if it is open or within its grace (an expired one is dropped)."""
        stream = self._streams.get(worker_id)
        if (
            stream is not None
            and not stream.open
            and (time.monotonic() - stream.since >= RECONNECT_GRACE_S)
        ):
            self._drop(worker_id)
            return None
        return stream

    def _prune(self) -> None:
        cutoff = time.monotonic() - RECONNECT_GRACE_S
        for worker_id in [w for w, s in self._streams.items() if not s.open and s.since < cutoff]:
            self._drop(worker_id)

    # --- state (any thread) --------------------------------------------------------------

    def connected(self, worker_id: str) -> bool:
        """Whether ``worker_id`` holds its command stream open to this process now."""
        stream = self._streams.get(worker_id)
        return stream is not None and stream.open

    def holds(self, worker_id: str) -> bool:
        """Whether commands for ``worker_id`` are queued here: its stream is open, dropped
        moments ago, or expected (a push waits for it within the reconnect grace)."""
        stream = self._streams.get(worker_id)
        return stream is not None and (
            stream.open or time.monotonic() - stream.since < RECONNECT_GRACE_S
        )

    def queued_bytes(self, worker_id: str) -> int:
        stream = self._streams.get(worker_id)
        return 0 if stream is None else stream.nbytes

    # --- pushing -------------------------------------------------------------------------

    def remote(
        self, commands: Iterable[tuple[str, dict[str, Any]]]
    ) -> list[tuple[str, dict[str, Any]]]:
        """The commands the relay must carry: those of workers whose stream is not held here,
        and, with a relay, of those whose stream here dropped moments ago (it may come back
        here, or reconnect to another API process: both get the command, the worker drops the
        second)."""
        return [
            (worker_id, message)
            for worker_id, message in commands
            if not self.holds(worker_id)
            or (self.relay is not None and not self.connected(worker_id))
        ]

    def push(
        self, commands: Iterable[tuple[str, dict[str, Any]]], *, relayed: bool = False
    ) -> list[str]:
        """Deliver ``(worker_id, command)`` pairs; returns the worker ids whose commands wait
        here for a stream that is not open (none when a relay publishes them). ``relayed``:
        the relay's share (:meth:`remote`) was notified already, in the transaction that
        stored the commands. Raises :class:`RelayError` when the relay could not publish."""
        commands = list(commands)
        local = [(w, encode(message)) for w, message in commands if self.holds(w)]
        remote = self.remote(commands)
        if local and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, local)
        if remote and self.relay is not None:
            if not relayed:
                self.relay.publish(remote)
            return []
        if remote and self._loop is not None:
            # A worker attached moments ago may not have opened its stream yet: its commands
            # wait for it as for a stream that just dropped.
            self._loop.call_soon_threadsafe(
                self._hold, [(worker_id, encode(message)) for worker_id, message in remote]
            )
        return [worker_id for worker_id, _ in remote]

    def deliver_now(self, lines: Sequence[tuple[str, Line]]) -> None:
        """Deliver lines into streams held here (call on the event loop)."""
        if lines:
            self._deliver(lines)

    def deliver_threadsafe(self, messages: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Deliver commands into streams held here (any thread)."""
        if self._loop is not None and messages:
            lines = [(worker_id, encode(message)) for worker_id, message in messages]
            self._loop.call_soon_threadsafe(self._deliver, lines)

    def _hold(self, lines: list[tuple[str, Line]]) -> None:
        with self._lock:
            for worker_id, _ in lines:
                if self._live(worker_id) is None:
                    self._streams[worker_id] = _Stream()
        self._deliver(lines)

    def _deliver(self, lines: Sequence[tuple[str, Line]]) -> None:
        cut: list[tuple[str, str]] = []
        with self._lock:
            for worker_id, line in lines:
                stream = self._live(worker_id)
                if stream is None:
                    log.warning("worker %s disconnected before its command arrived", worker_id)
                    continue
                if line.key is not None:
                    if line.key in stream.keys:
                        stream.repeats += 1
                        continue
                    stream.keys[line.key] = None
                    if len(stream.keys) > SENT_KEYS:
                        stream.keys.popitem(last=False)
                stream.lines.append(line)
                stream.nbytes += line.nbytes
                self.nbytes += line.nbytes
                if stream.nbytes > STREAM_BYTES_MAX or self.nbytes > HUB_BYTES_MAX:
                    cut.append(
                        (
                            worker_id,
                            f"{stream.nbytes} bytes of commands queued for "
                            f"it, {self.nbytes} for every stream of this process",
                        )
                    )
                    self._drop(worker_id)
                    continue
                stream.wake.set()
        for worker_id, why in cut:
            self.cuts += 1
            log.warning(
                "worker %s is not reading its commands (%s); its stream is cut and its "
                "transfers' commands are owed again when it reconnects",
                worker_id,
                why,
            )


class CommandStreamResponse(StreamingResponse):
    """A command stream whose every write must complete within ``write_timeout_s``: a worker
    that does not read is cut (``on_stall``) instead of holding the server's memory."""

    def __init__(
        self,
        content: Any,
        *,
        on_stall: Callable[[], None],
        write_timeout_s: float = WRITE_TIMEOUT_S,
        **options: Any,
    ) -> None:
        super().__init__(content, **options)
        self.on_stall = on_stall
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        stalled = False

        async def timed(message: Message) -> None:
            nonlocal stalled
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                stalled = True
                raise

        try:
            await super().stream_response(timed)
        except TimeoutError:
            if not stalled:
                raise
            self.on_stall()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            # Returning without finishing the body makes the server close the connection.


class Completions:
    """Per-transfer events that waiters sleep on; set when a transfer settles."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, tuple[asyncio.Event, int]] = {}
        # What a transfer settled as, when whoever settled it here read it for its waiters
        self._results: dict[str, Any] = {}

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
            self._results.pop(transfer_id, None)
        else:
            self._events[transfer_id] = (found[0], found[1] - 1)

    def waited(self) -> list[str]:
        """The transfer ids somebody waits for here now."""
        return list(self._events)

    def result(self, transfer_id: str) -> Any | None:
        """The transfer as it settled, when its settler read it for this process's waiters
        (call on the event loop, once its event is set)."""
        return self._results.get(transfer_id)

    def settled(self, transfer_ids: Iterable[str], results: dict[str, Any] | None = None) -> None:
        """Wake the waiters of ``transfer_ids`` (thread-safe); ``results``: some of them as
        they settled, which their waiters answer with instead of reading them again."""
        ids = list(transfer_ids)
        if ids and self._loop is not None:
            self._loop.call_soon_threadsafe(self._set, ids, results or {})

    def _set(self, ids: list[str], results: dict[str, Any]) -> None:
        for transfer_id in ids:
            found = self._events.get(transfer_id)
            if found is not None:
                if transfer_id in results:
                    self._results[transfer_id] = results[transfer_id]
                found[0].set()


#: ``resolve(refs)``: the commands of these references, built from the database:
#: ``[(worker_id, transfer_id, attempt, side, rank)] -> [(worker_id, command)]``
Resolver = Callable[[list[tuple[str, str, int, str, int]]], list[tuple[str, dict[str, Any]]]]


class PostgresRelay:
    """Commands for workers connected to another API process, through ``LISTEN``/``NOTIFY``.

    A notification carries references to commands (worker id, transfer id, attempt, side,
    rank; a few dozen per notification), a stream to close, or transfer ids that settled.
    Every process listens on one connection in a thread; for the workers whose streams it
    holds it builds the referenced commands from the database (``resolve``) and delivers
    them. It publishes on a second connection that it keeps open (connecting per push cost
    about 16 ms on loopback; a ``NOTIFY`` on a held one 0.2 ms).
    """

    def __init__(
        self,
        url: str,
        hub: CommandHub,
        completions: Completions | None = None,
        resolve: Resolver | None = None,
    ) -> None:
        self.url = url
        self.hub = hub
        self.completions = completions
        self.resolve = resolve
        self._publisher: Any = None  # the held publishing connection, under _publish_lock
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self.listening = threading.Event()  # LISTEN is active: notifications reach this process
        self._thread = threading.Thread(target=self._listen, daemon=True, name="kvplane-relay")
        self._thread.start()

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(self.url, autocommit=True)

    def publish(self, messages: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Publish references to these commands (raises :class:`RelayError` on failure)."""
        self._notify(self.ref_payloads(messages), required=True)

    def ref_payloads(self, messages: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
        """The notifications that carry references to these commands."""
        refs = [
            [worker_id, m["transfer_id"], int(m["attempt"]), m["side"], int(m["rank"])]
            for worker_id, m in messages
        ]
        return [
            json.dumps(
                {"refs": refs[i : i + REFS_PER_NOTIFY], "origin": self.hub.origin},
                separators=(",", ":"),
            )
            for i in range(0, len(refs), REFS_PER_NOTIFY)
        ]

    @staticmethod
    def notify_in(session: Any, payloads: Sequence[str]) -> None:
        """Send ``payloads`` with the transaction of ``session`` (a SQLAlchemy session on this
        database): PostgreSQL delivers them when it commits, and never if it rolls back."""
        from sqlalchemy import text

        for payload in payloads:
            session.execute(
                text("SELECT pg_notify(:channel, :payload)"),
                {"channel": NOTIFY_CHANNEL, "payload": payload},
            )

    def publish_close(self, worker_id: str, message: dict[str, Any]) -> None:
        """Tell the other processes to end ``worker_id``'s stream with ``message``."""
        self._notify(
            [
                json.dumps(
                    {"close": worker_id, "message": message, "origin": self.hub.origin},
                    separators=(",", ":"),
                )
            ]
        )

    def publish_settled(self, transfer_ids: list[str]) -> None:
        """Tell the other processes that these transfers settled (their waiters wake)."""
        self._notify(self.settled_payloads(transfer_ids))

    def settled_payloads(self, transfer_ids: list[str]) -> list[str]:
        """The notifications that say these transfers settled."""
        return [
            json.dumps(
                {"settled": transfer_ids[i : i + SETTLED_PER_NOTIFY], "origin": self.hub.origin},
                separators=(",", ":"),
            )
            for i in range(0, len(transfer_ids), SETTLED_PER_NOTIFY)
        ]

    def _notify(self, payloads: list[str], *, required: bool = False) -> None:
        if not payloads:
            return
        with self._publish_lock:
            # Twice at most: a held connection may have died since the last push (a database
            # restart). A notification sent twice is harmless (streams drop repeats).
            for attempt in range(2):
                try:
                    if self._publisher is None or self._publisher.closed:
                        self._publisher = self._connect()
                    for payload in payloads:
                        self._publisher.execute(
                            "SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, payload)
                        )
                    return
                except Exception as error:
                    self._drop_publisher()
                    if attempt:
                        log.warning("relaying %d notification(s) failed: %s", len(payloads), error)
                        if required:
                            raise RelayError(str(error)) from error

    def _drop_publisher(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            with contextlib.suppress(Exception):  # it is broken already
                publisher.close()

    def _on_note(self, data: dict[str, Any]) -> None:
        if "settled" in data:
            if self.completions is not None:
                self.completions.settled(data["settled"])
        elif "close" in data:
            if self.hub.holds(data["close"]) and self.hub._loop is not None:
                self.hub._loop.call_soon_threadsafe(self.hub._close, data["close"], data["message"])
        elif "refs" in data and self.resolve is not None:
            refs = [
                (str(w), str(t), int(a), str(s), int(r))
                for w, t, a, s, r in data["refs"]
                if self.hub.holds(str(w))
            ]
            if refs:
                self.hub.deliver_threadsafe(self.resolve(refs))

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
                            try:
                                self._on_note(data)
                            except Exception as error:  # one bad note must not stop the relay
                                log.warning(
                                    "dispatch relay: cannot deliver %s: %s",
                                    note.payload[:200],
                                    error,
                                )
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
