"""The control plane on its own host with PostgreSQL.

PostgreSQL listens on the root namespace's 127.0.0.1, which ``kvp-cp`` cannot reach; the control
plane connects through the server's Unix socket instead (namespaces share the file system), as
docs/operators.md describes. The demo fleet registers, pairs and moves verified pages across
the bed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from workers.testing.engine import Fleet
from workers.testing.netbed import DATA_DEVICE, Bed

from .conftest import HOSTS, assert_clean

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(600)]


@pytest.fixture
def fleet(bed: Bed, postgres_socket_url: str, tmp_path: Path) -> Iterator[Fleet]:
    running = Fleet(
        tmp_path,
        num_slots=32,
        fill=True,
        staging_bytes=16 << 20,
        ucx_tls="tcp",
        ucx_net_devices=DATA_DEVICE,
        host=bed.address("cp"),
        hosts=HOSTS,
        server_env={"KVPLANE_DATABASE_URL": postgres_socket_url},
    )
    try:
        running.start()
        yield running
    finally:
        running.stop()


def test_control_plane_host_on_postgresql_through_its_socket(
    fleet: Fleet, postgres_socket_url: str
) -> None:
    run = fleet.run_engine(requests=4, blocks=4, in_flight=2, verify=True, timeout_s=60)
    assert_clean(run)
    # What the control plane in kvp-cp stored is in this test's PostgreSQL database.
    engine = create_engine(postgres_socket_url)
    try:
        with engine.connect() as conn:
            instances = conn.execute(text("SELECT count(*) FROM instances")).scalar_one()
            workers = conn.execute(text("SELECT count(*) FROM workers")).scalar_one()
    finally:
        engine.dispose()
    assert (instances, workers) == (2, 6)
