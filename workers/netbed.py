"""Several hosts on one machine: network namespaces on a bridge, and the faults tests inject.

The bed (``python -m workers.netbed up``, ``make hosts-up``; root only)::

    namespace kvp-cp   eth0 10.77.0.1/24 ─┐
    namespace kvp-ctx  eth0 10.77.0.2/24 ─┼─ bridge kvp-br0 (root namespace, 10.77.0.254/24)
    namespace kvp-gen  eth0 10.77.0.3/24 ─┘

Every host is a network namespace with one veth pair: ``eth0`` inside, ``kvp-<host>-b`` on the
bridge (the "switch port"). The root namespace keeps 10.77.0.254 on the bridge so a driver (a
test, a benchmark, an operator's shell) reaches every host; no host uses 127.0.0.1 to reach
another. Each namespace sets ``net.ipv4.tcp_retries2`` (default 3 here: an established TCP
connection whose peer vanished fails after about 3 s instead of about 15 minutes), so UCX
reports a dead peer within a test's patience.

Processes are started with ``ip netns exec`` (:meth:`Bed.command`), which also mounts the
namespace's own ``/sys``: UCX lists network devices under ``/sys/class/net``.

Faults, all on one host's ``eth0`` (undone by :meth:`Bed.heal`):

- :meth:`Bed.loss`: nftables drops ``percent`` % of the host's packets in each direction
  (``numgen random mod 100 < N drop``);
- :meth:`Bed.rate`: ``tc tbf`` limits the host's egress bandwidth;
- :meth:`Bed.partition`: the host's switch port goes down (``ip link set kvp-<host>-b down``):
  nothing reaches it or leaves it, established connections stay open until TCP gives up;
- :meth:`Bed.delay`: a user-space relay (:class:`DelayRelay`) holds every packet between two
  hosts' TUN devices for ``ms`` milliseconds (there is no netem here).

A database a control plane in ``kvp-cp`` uses: SQLite (a file: namespaces share the file system)
or PostgreSQL through its Unix socket (``?host=/var/run/postgresql``): the server listens on the
root namespace's 127.0.0.1, which no other namespace can reach.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PREFIX = "kvp-"
BRIDGE = "kvp-br0"
SUBNET = "10.77.0"
DRIVER_ADDRESS = f"{SUBNET}.254"
HOSTS = {"cp": 1, "ctx": 2, "gen": 3}
DEVICE = "eth0"
TCP_RETRIES2 = 3


class BedError(RuntimeError):
    """The bed cannot be built here (not root, no namespaces, a tool missing)."""


def run(*argv: str, check: bool = True, input: str | None = None) -> str:
    """Run a command; its stdout. :class:`BedError` with stderr when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, input=input, check=False)
    if check and result.returncode != 0:
        raise BedError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


def available() -> str | None:
    """Why the bed cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (Debian: iproute2, nftables)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        run("ip", "netns", "add", probe)
    except BedError as error:
        return f"cannot create a network namespace: {error}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Bed:
    """The namespaces, their veth pairs and the bridge; :meth:`up`, faults, :meth:`down`."""

    hosts: Mapping[str, int] = field(default_factory=lambda: dict(HOSTS))
    tcp_retries2: int = TCP_RETRIES2

    def ns(self, host: str) -> str:
        return f"{PREFIX}{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts[host]}"

    def port(self, host: str) -> str:
        """The host's switch port on the bridge (root namespace side of its veth)."""
        return f"{PREFIX}{host}-b"

    # --- building ----------------------------------------------------------------------------

    def up(self) -> Bed:
        """Build the bed (tearing down leftovers of an earlier one first)."""
        self.down()
        try:
            run("ip", "link", "add", BRIDGE, "type", "bridge")
            run("ip", "addr", "add", f"{DRIVER_ADDRESS}/24", "dev", BRIDGE)
            run("ip", "link", "set", BRIDGE, "up")
            for host in self.hosts:
                ns, port = self.ns(host), self.port(host)
                run("ip", "netns", "add", ns)
                run("ip", "link", "add", port, "type", "veth", "peer", "name", f"{port[:-2]}-i")
                run("ip", "link", "set", f"{port[:-2]}-i", "netns", ns, "name", DEVICE)
                run("ip", "link", "set", port, "master", BRIDGE, "up")
                self.exec(host, "ip", "link", "set", "lo", "up")
                self.exec(host, "ip", "addr", "add", f"{self.address(host)}/24", "dev", DEVICE)
                self.exec(host, "ip", "link", "set", DEVICE, "up")
                self.exec(host, "sysctl", "-q", "-w", f"net.ipv4.tcp_retries2={self.tcp_retries2}")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove every namespace and link this bed (or an earlier one) created."""
        for ns in run("ip", "netns", "list", check=False).split():
            if ns.startswith(PREFIX) and not ns.startswith(f"{PREFIX}probe"):
                run("ip", "netns", "del", ns, check=False)  # its veths (and their peers) go too
        run("ip", "link", "del", BRIDGE, check=False)
        for host in self.hosts:
            run("ip", "link", "del", self.port(host), check=False)

    def exec(self, host: str, *argv: str, check: bool = True) -> str:
        return run("ip", "netns", "exec", self.ns(host), *argv, check=check)

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as it runs on ``host`` (for ``subprocess.Popen``)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def counters(self, host: str) -> dict[str, int]:
        """Bytes and packets through the host's ``eth0`` so far."""
        base = f"/sys/class/net/{DEVICE}/statistics"
        out = self.exec(
            host,
            "cat",
            f"{base}/rx_bytes",
            f"{base}/tx_bytes",
            f"{base}/rx_packets",
            f"{base}/tx_packets",
        ).split()
        return dict(
            zip(("rx_bytes", "tx_bytes", "rx_packets", "tx_packets"), map(int, out), strict=True)
        )

    # --- faults ------------------------------------------------------------------------------

    def tcp_retries(self, host: str, retries: int) -> None:
        """``net.ipv4.tcp_retries2`` of ``host`` (15 is Linux's default: about 15 minutes before
        an established connection to a vanished peer fails; the bed uses 3)."""
        self.exec(host, "sysctl", "-q", "-w", f"net.ipv4.tcp_retries2={retries}")

    def loss(self, host: str, percent: int) -> None:
        """Drop ``percent`` % of ``host``'s packets, in each direction (nftables)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"loss {percent} %: between 0 and 100")
        self._nft_clear(host)
        rules = (
            "table inet kvp_loss {\n"
            "  chain kvp_in {\n"
            "    type filter hook input priority 0; policy accept;\n"
            f'    iifname "{DEVICE}" numgen random mod 100 < {percent} drop\n'
            "  }\n"
            "  chain kvp_out {\n"
            "    type filter hook output priority 0; policy accept;\n"
            f'    oifname "{DEVICE}" numgen random mod 100 < {percent} drop\n'
            "  }\n"
            "}\n"
        )
        run("ip", "netns", "exec", self.ns(host), "nft", "-f", "-", input=rules)

    def rate(self, host: str, rate: str, *, burst: str = "1mb", latency: str = "50ms") -> None:
        """Limit ``host``'s egress to ``rate`` (``tc tbf``, e.g. ``"1gbit"``)."""
        self.exec(
            host,
            "tc",
            "qdisc",
            "replace",
            "dev",
            DEVICE,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst,
            "latency",
            latency,
        )

    def partition(self, host: str) -> None:
        """Cut ``host`` off the network (its switch port goes down)."""
        run("ip", "link", "set", self.port(host), "down")

    def reconnect(self, host: str) -> None:
        run("ip", "link", "set", self.port(host), "up")

    def heal(self, host: str | None = None) -> None:
        """Undo every fault on ``host`` (every host when None)."""
        for name in [host] if host else list(self.hosts):
            self._nft_clear(name)
            self.exec(name, "tc", "qdisc", "del", "dev", DEVICE, "root", check=False)
            self.tcp_retries(name, self.tcp_retries2)
            with contextlib.suppress(BedError):
                self.reconnect(name)

    def _nft_clear(self, host: str) -> None:
        self.exec(host, "nft", "delete", "table", "inet", "kvp_loss", check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.netbed", description="Network-namespace hosts for kvplane tests."
    )
    parser.add_argument("action", choices=["up", "down", "status"])
    args = parser.parse_args(argv)
    bed = Bed()
    if args.action == "up":
        why = available()
        if why:
            print(f"cannot build the bed: {why}", file=sys.stderr)
            return 1
        bed.up()
        for host in bed.hosts:
            print(f"{bed.ns(host):8} {bed.address(host)}  (ip netns exec {bed.ns(host)} ...)")
        print(f"driver   {DRIVER_ADDRESS} on {BRIDGE}")
    elif args.action == "down":
        bed.down()
        print("bed removed")
    else:
        print(run("ip", "netns", "list", check=False) or "no namespaces")
    return 0


if __name__ == "__main__":
    sys.exit(main())
