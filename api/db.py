"""Engine, sessions and transactions.

SQLite (default) runs in WAL mode with ``foreign_keys=ON`` and a ``busy_timeout``; write
transactions start with ``BEGIN IMMEDIATE`` so two writers queue on the lock instead of
deadlocking on an upgrade from a read lock. Within one process, writers first queue on a Python
lock: SQLite's busy handler polls with sleeps of up to 100 ms, so under a burst of writes
(records, REST transfers, heartbeats) a waiter slept long after the lock was free; the Python
lock hands it over at once. The busy handler still arbitrates between processes. A lock that
outlasts the busy timeout surfaces as ``OperationalError("database is locked")``, which
``api.errors`` turns into 503 + Retry-After.
PostgreSQL uses psycopg 3 at ``READ COMMITTED`` with ``pool_pre_ping``.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    DateTime,
    Dialect,
    Engine,
    Float,
    MetaData,
    TypeDecorator,
    create_engine,
    event,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.sql.functions import FunctionElement

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SQLITE_BUSY_TIMEOUT_MS = 5000
_WRITE_OPTION = "kvplane_write"


class Base(DeclarativeBase):
    """Declarative base with a naming convention (Alembic batch mode needs named constraints)."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend (SQLite stores it naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class seconds_between(FunctionElement[float]):  # lower case: used like a func.* SQL function
    """``end - start`` in seconds, in SQL: two :class:`UTCDateTime` columns (or expressions).

    SQLite has no interval type: the difference of the two Julian days, to the millisecond (the
    precision of its date functions). PostgreSQL: the epoch of the interval, to the microsecond.
    """

    type = Float()
    name = "seconds_between"
    inherit_cache = True


@compiles(seconds_between, "sqlite")
def _seconds_between_sqlite(element: seconds_between, compiler: Any, **kw: Any) -> str:
    start, end = (compiler.process(clause, **kw) for clause in element.clauses)
    # Rounded to the millisecond: the Julian days' float error is tens of microseconds.
    return f"round((julianday({end}) - julianday({start})) * 86400.0, 3)"


@compiles(seconds_between, "postgresql")
def _seconds_between_postgresql(element: seconds_between, compiler: Any, **kw: Any) -> str:
    start, end = (compiler.process(clause, **kw) for clause in element.clauses)
    return f"CAST(EXTRACT(EPOCH FROM ({end} - {start})) AS DOUBLE PRECISION)"


def is_sqlite(url: str) -> bool:
    """True when ``url`` names a SQLite database."""
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, *, sqlite_busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> Engine:
    """Create an engine configured for kvplane's concurrency rules on SQLite or PostgreSQL."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, isolation_level="READ COMMITTED")

    database = parsed.database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": sqlite_busy_timeout_ms / 1000},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module so that "begin" below decides.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(sqlite_busy_timeout_ms)}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get(_WRITE_OPTION):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")

    return engine


class Database:
    """One engine and two session factories: read transactions and write transactions."""

    def __init__(self, url: str, *, sqlite_busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> None:
        self.url = url
        self.engine = make_engine(url, sqlite_busy_timeout_ms=sqlite_busy_timeout_ms)
        write_engine = self.engine.execution_options(**{_WRITE_OPTION: True})
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(write_engine, expire_on_commit=False)
        # SQLite has one writer at a time: this process's writers queue here (see the module).
        self._write_lock = threading.RLock() if is_sqlite(url) else None
        self._write_wait_s = sqlite_busy_timeout_ms / 1000

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session inside a read transaction (rolled back on exit)."""
        with self._read() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session inside a write transaction: committed on success, rolled back on error."""
        lock = self._write_lock
        if lock is not None and not lock.acquire(timeout=self._write_wait_s):
            raise OperationalError(
                "BEGIN IMMEDIATE", None, sqlite3.OperationalError("database is locked")
            )
        try:
            with self._write() as session, session.begin():
                yield session
        finally:
            if lock is not None:
                lock.release()

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()
