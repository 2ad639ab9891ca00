"""The control plane on its own host with PostgreSQL.

PostgreSQL listens on the root namespace's 127.0.0.1, which ``kvp-cp`` cannot reach; the control
plane connects through the server's Unix socket instead (namespaces share the file system), as
docs/operators.md describes. The demo fleet registers, pairs and moves verified pages across
the bed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from workers.engine_loop import Fleet
from workers.netbed import Bed

from .conftest import HOSTS, IN_CI, assert_clean

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(600)]

SOCKET_DIR = Path(os.environ.get("KVPLANE_TEST_POSTGRES_SOCKET", "/var/run/postgresql"))


@pytest.fixture
def socket_url(postgres_url: str) -> str:
    """This test's fresh PostgreSQL database, reached through the server's Unix socket."""
    if not SOCKET_DIR.is_dir():
        if IN_CI:
            pytest.fail(f"CI=true: no PostgreSQL socket directory {SOCKET_DIR}")
        pytest.skip(f"no PostgreSQL socket directory {SOCKET_DIR} (KVPLANE_TEST_POSTGRES_SOCKET)")
    url = make_url(postgres_url).set(host="", port=None, query={"host": str(SOCKET_DIR)})
    return url.render_as_string(hide_password=False)


@pytest.fixture
def fleet(bed: Bed, socket_url: str, tmp_path: Path) -> Iterator[Fleet]:
    running = Fleet(
        tmp_path,
        num_slots=32,
        fill=True,
        staging_bytes=16 << 20,
        ucx_tls="tcp",
        host=bed.address("cp"),
        hosts=HOSTS,
        server_env={"KVPLANE_DATABASE_URL": socket_url},
    )
    try:
        running.start()
        yield running
    finally:
        running.stop()


def test_control_plane_host_on_postgresql_through_its_socket(fleet: Fleet, socket_url: str) -> None:
    run = fleet.run_engine(requests=4, blocks=4, in_flight=2, verify=True, timeout_s=60)
    assert_clean(run)
    # What the control plane in kvp-cp stored is in this test's PostgreSQL database.
    engine = create_engine(socket_url)
    try:
        with engine.connect() as conn:
            instances = conn.execute(text("SELECT count(*) FROM instances")).scalar_one()
            workers = conn.execute(text("SELECT count(*) FROM workers")).scalar_one()
    finally:
        engine.dispose()
    assert (instances, workers) == (2, 6)
