"""What UCX actually uses (``workers/transport/ucx_log.py``): its endpoint configurations, parsed
from UCX's own info-level log; and two real NIXL endpoints in a fresh process that report the
transport the bytes of a WRITE took (shared memory by default on one machine, TCP with ``tcp``,
only the pinned device with ``ucx_net_devices``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers.transport.ucx_log import UcxLog, parse_line, summarize

ROOT = Path(__file__).resolve().parents[2]

# Captured from two NIXL agents ``a`` and ``b`` of one process (UCX 1.23.0), UCX's defaults ...
DEFAULT_LOG = """\
[1796145928.193547] [vm:13684:0]     ucp_context.c:2753 UCX  INFO  Version 1.23.0 (loaded from /x/libucp.so.0.0.0, git branch <unknown>, revision 65e342a)
[1796145928.202872] [vm:13684:0]          parser.c:2587 UCX  INFO  UCX_* env variables: UCX_LOG_FILE=/tmp/ucxwt/d.%p.log UCX_LOG_LEVEL=info
[1796145928.207798] [vm:13684:0]      ucp_worker.c:1997 UCX  INFO    a self cfg#0 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
[1796145928.268184] [vm:13684:0]      ucp_worker.c:1997 UCX  INFO    b self cfg#0 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
[1796145928.294178] [vm:13684:0]      ucp_worker.c:1997 UCX  INFO    a intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
[1796145928.316139] [vm:13684:0]      ucp_worker.c:1997 UCX  INFO    b intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
[1796145931.410581] [vm:13684:1]          tcp_ep.c:1260 UCX  DIAG  tcp_ep 0x5652b8c655c0 (state=CONNECTED): recv(37) failed: Connection reset by remote peer
"""  # noqa: E501
# ... and with UCX_TLS=tcp (the agent ``a`` of a worker whose name UCX cut to 31 characters).
TCP_LOG = """\
[1796145930.992390] [vm:13691:0]          parser.c:2587 UCX  INFO  UCX_* env variables: UCX_LOG_FILE=/tmp/ucxwt/t.%p.log UCX_LOG_LEVEL=info UCX_TLS=tcp
[1796145930.993103] [vm:13691:0]      ucp_worker.c:1997 UCX  INFO    a-very-long-instance-name-for-t self cfg#0 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo tcp/eth0)  ka(tcp/lo)
[1796145931.035706] [vm:13691:0]      ucp_worker.c:1997 UCX  INFO    a-very-long-instance-name-for-t intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo tcp/eth0)  ka(tcp/lo)
"""  # noqa: E501
LONG_AGENT = "a-very-long-instance-name-for-testing.r0.abcdef12"


def _report(text: str, agent: str) -> dict | None:
    configs = [c for c in (parse_line(line) for line in text.splitlines()) if c is not None]
    return summarize(c for c in configs if c.names(agent))


def test_the_default_report_shows_shared_memory_beside_tcp() -> None:
    assert _report(DEFAULT_LOG, "a") == {
        "transports": ["tcp/lo", "cma/memory"],
        "lanes": {
            "rma_am": ["tcp/lo"],
            "amo_am": ["tcp/lo"],
            "am": ["tcp/lo", "cma/memory"],
            "ka": ["tcp/lo"],
        },
        "peers": ["intra-node"],
        "shared_memory": True,
    }


def test_with_tcp_only_the_network_stack_shows() -> None:
    report = _report(TCP_LOG, LONG_AGENT)
    assert report is not None
    assert report["transports"] == ["tcp/lo", "tcp/eth0"]
    assert report["shared_memory"] is False


def test_only_this_agents_peer_configurations_count() -> None:
    self_only = "\n".join(line for line in DEFAULT_LOG.splitlines() if " self " in line)
    assert _report(self_only, "a") is None  # the loopback to itself is no peer connection
    assert _report(DEFAULT_LOG, "c") is None
    assert _report(DEFAULT_LOG, "ab") is None  # a name UCX did not cut must match exactly
    assert _report(TCP_LOG, "a-very-long-instance-name-for-x.r1") is None


@pytest.mark.parametrize(
    "line",
    [
        "",
        "garbage",
        "UCX  INFO  a intra-node",
        "UCX  INFO    a intra-node cfg#x am(tcp/lo)",
        "UCX  INFO    a intra-node cfg#1 am(tcp/lo",
        "UCX  WARN    a intra-node cfg#1 am(tcp/lo)",
        "\x00\xff",
        "UCX  INFO    a intra-node cfg#1 nothing",
    ],
)
def test_unknown_lines_are_ignored(line: str) -> None:
    assert parse_line(line) is None


def test_a_missing_file_is_unknown_and_new_bytes_are_read_once(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = tmp_path / "ucx.log"
    log = UcxLog(str(path))
    request.addfinalizer(log.close)
    assert log.report("a") is None  # no file yet
    lines = DEFAULT_LOG.splitlines(keepends=True)
    path.write_text("".join(lines[:4]) + lines[4][:40])  # a line still being written
    mark = log.mark()
    assert log.report("a") is None
    with path.open("a") as f:
        f.write(lines[4][40:])
    report = log.report("a", since=mark)
    assert report is not None and report["peers"] == ["intra-node"]
    assert log.report("a", since=log.mark()) is None  # configurations before a mark don't count
    assert UcxLog(None).report("a") is None


def test_a_file_ucx_started_over_is_read_from_its_beginning(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = tmp_path / "ucx.log"
    path.write_text(DEFAULT_LOG.splitlines(keepends=True)[2])
    log = UcxLog(str(path))
    request.addfinalizer(log.close)
    assert log.report("a") is None  # only self
    path.unlink()  # UCX at its size limit: unlink, open the name again
    path.write_text(DEFAULT_LOG.splitlines(keepends=True)[4])
    report = log.report("a")
    assert report is not None and report["transports"] == ["tcp/lo", "cma/memory"]


# --- real NIXL endpoints in a fresh process ----------------------------------------------------

PROBE = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from workers.pools import PoolSpec, allocate_pools
    from workers.transport.nixl import NixlTransport
    tls, devices = sys.argv[1] or None, sys.argv[2] or None
    def endpoint(name):
        pools = allocate_pools([PoolSpec(0, 4096, 4096, 4)], "cpu")
        return NixlTransport(
            name, pools, staging_bytes=1 << 20, ucx_tls=tls, ucx_net_devices=devices
        )
    a, b = endpoint("probe-a"), endpoint("probe-b")
    before = a.ucx_in_use()
    a.add_peer(b.peer_info()); b.add_peer(a.peer_info())
    src = a.local_staging_desc(0, 1 << 20)
    dst = a.desc(np.array([b.staging.data_ptr()]), np.array([1 << 20]), 0)
    handle = a.post_write("probe-b", src, dst, b"x", "t")
    while not a.poll(handle):
        pass
    print(json.dumps({"before": before, "after": a.ucx_in_use(),
                      "log": os.environ.get("UCX_LOG_FILE")}))
    a.close(); b.close()
""")


def _probe(tls: str, env: dict[str, str] | None = None, *, devices: str = "") -> dict:
    pytest.importorskip("nixl")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, tls, devices],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_ucx_defaults_on_one_machine_move_the_bytes_through_shared_memory() -> None:
    result = _probe("")
    assert result["before"] is None  # no peer connection yet: unknown
    after = result["after"]
    assert after is not None, result
    assert after["peers"] == ["intra-node"]
    assert after["shared_memory"] is True
    assert any(t.endswith("/memory") for t in after["lanes"]["am"])


@pytest.mark.slow
def test_with_tcp_the_report_names_tcp_and_no_shared_memory() -> None:
    after = _probe("tcp")["after"]
    assert after is not None
    assert after["shared_memory"] is False
    assert "tcp/lo" in after["transports"]
    assert all(t.startswith("tcp/") for t in after["transports"])


@pytest.mark.slow
def test_pinned_network_devices_are_the_only_ones_ucx_uses() -> None:
    # Unpinned, UCX_TLS=tcp uses every interface that is up (tcp/lo and tcp/eth0 on a machine
    # with one NIC); NIXL's own device parameter would have changed nothing here (it is passed
    # on as lo:1, an RDMA port name).
    after = _probe("tcp", devices="lo")["after"]
    assert after is not None
    assert after["transports"] == ["tcp/lo"], after


@pytest.mark.slow
def test_a_log_level_the_user_chose_is_left_alone_and_the_report_is_unknown() -> None:
    result = _probe("", {"UCX_LOG_LEVEL": "warn"})
    assert result["log"] is None
    assert result["after"] is None
