"""Shared fixtures: one fresh migrated database per test, on SQLite and on PostgreSQL.

- SQLite: the schema is migrated once per session into a template file, copied per test.
- PostgreSQL (``KVPLANE_TEST_POSTGRES_URL``): a migrated template database per session, and per
  test ``CREATE DATABASE … TEMPLATE`` under a unique name, dropped afterwards. Without a server the
  tier is skipped loudly, except under ``CI=true`` where that is a failure.

``db_url`` is parametrized over both backends; ``app`` and ``client`` build on it.

``bed`` (session): the three-host network-namespace bed of ``workers/testing/netbed.py``
(``kvp-cp``, ``kvp-ctx``, ``kvp-gen`` on a bridge), built once and removed at the end; skipped
loudly where namespaces cannot be built, a failure under ``CI=true``. ``postgres_socket_url``:
this test's PostgreSQL database through the server's Unix socket, which a namespace reaches (the
server listens on the root namespace's 127.0.0.1 only).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from api.app import create_app
from api.migrate import upgrade
from api.settings import Settings

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

_postgres_skip_reason: list[str] = []
_bed_skip_reason: list[str] = []
POSTGRES_SOCKET_DIR = Path(os.environ.get("KVPLANE_TEST_POSTGRES_SOCKET", "/var/run/postgresql"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for tier, reasons in (("PostgreSQL", _postgres_skip_reason), ("multi-host", _bed_skip_reason)):
        if reasons:
            terminalreporter.write_sep(
                "!", f"{tier} tier SKIPPED: {reasons[0]}", red=True, bold=True
            )


def _relays() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kvplane-relay"}


@pytest.fixture(autouse=True)
def _no_relay_outlives_its_test() -> Iterator[None]:
    """An app's PostgreSQL dispatch relay ends with its lifespan: one left running reconnects to
    a dropped database once a second for the rest of the run."""
    before = _relays()
    yield
    deadline = time.monotonic() + 3.0  # close() lets the listener see the stop within 1 s
    while (left := _relays() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, "a dispatch relay outlived its test (an app's lifespan never ended)"


def _postgres_admin_url() -> str:
    return os.environ.get("KVPLANE_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)


def _admin_engine(url: str):  # type: ignore[no-untyped-def]
    return create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)


def _drop_database(admin_url: str, name: str) -> None:
    engine = _admin_engine(admin_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head, once per session."""
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    """A fresh migrated SQLite database (a copy of the template)."""
    path = tmp_path / "kvplane.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The admin URL of a reachable PostgreSQL server, or skip (fail under CI=true)."""
    url = _postgres_admin_url()
    engine = _admin_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as error:  # any connection failure means "no server"
        reason = f"no PostgreSQL at {make_url(url).render_as_string(hide_password=True)}: {error}"
        if IN_CI:
            pytest.fail(f"CI=true requires PostgreSQL: {reason}")
        if not _postgres_skip_reason:
            _postgres_skip_reason.append(reason.splitlines()[0])
        pytest.skip(f"PostgreSQL tier SKIPPED: {reason.splitlines()[0]}")
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="session")
def postgres_template(postgres_server: str) -> Iterator[str]:
    """A PostgreSQL database migrated to head, once per session; its name."""
    name = f"kvplane_tpl_{uuid.uuid4().hex[:12]}"
    engine = _admin_engine(postgres_server)
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    try:
        upgrade(make_url(postgres_server).set(database=name).render_as_string(hide_password=False))
        yield name
    finally:
        _drop_database(postgres_server, name)


@pytest.fixture
def postgres_empty_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database (for migration tests)."""
    name = f"kvplane_t_{uuid.uuid4().hex[:12]}"
    engine = _admin_engine(postgres_server)
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    try:
        yield make_url(postgres_server).set(database=name).render_as_string(hide_password=False)
    finally:
        _drop_database(postgres_server, name)


@pytest.fixture
def postgres_url(postgres_server: str, postgres_template: str) -> Iterator[str]:
    """A fresh migrated PostgreSQL database (``CREATE DATABASE … TEMPLATE``)."""
    name = f"kvplane_t_{uuid.uuid4().hex[:12]}"
    engine = _admin_engine(postgres_server)
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{postgres_template}"'))
    engine.dispose()
    try:
        yield make_url(postgres_server).set(database=name).render_as_string(hide_password=False)
    finally:
        _drop_database(postgres_server, name)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """A fresh migrated database URL, once per backend."""
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


@pytest.fixture
def make_app(db_url: str) -> Callable[..., FastAPI]:
    """Build an app bound to this test's database (extra settings as keyword arguments)."""

    def _make(**overrides: object) -> FastAPI:
        return create_app(Settings(database_url=db_url, **overrides))  # type: ignore[arg-type]

    return _make


@pytest.fixture
def app(make_app: Callable[..., FastAPI]) -> FastAPI:
    """The app on this test's database."""
    return make_app()


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    """A TestClient on ``app`` (lifespan run)."""
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def postgres_socket_url(postgres_url: str) -> str:
    """This test's fresh PostgreSQL database, reached through the server's Unix socket."""
    if not POSTGRES_SOCKET_DIR.is_dir():
        reason = (
            f"no PostgreSQL socket directory {POSTGRES_SOCKET_DIR} (set KVPLANE_TEST_"
            "POSTGRES_SOCKET)"
        )
        if IN_CI:
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)
    url = make_url(postgres_url).set(host="", port=None, query={"host": str(POSTGRES_SOCKET_DIR)})
    return url.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def bed() -> Iterator[Any]:
    """The three-host bed (``workers.testing.netbed.Bed``), built once; torn down at the end."""
    from workers.testing import netbed

    why = netbed.available()
    if why is not None:
        if IN_CI:
            pytest.fail(f"CI=true requires the multi-host bed: {why}")
        if not _bed_skip_reason:
            _bed_skip_reason.append(why)
        pytest.skip(f"multi-host tier SKIPPED: {why}")
    built = netbed.Bed()
    try:
        built.up()
        yield built
    finally:
        built.down()
