"""Several hosts on one machine: network namespaces on two bridges, and the faults tests inject.

The bed (``python -m workers.testing.netbed up``, ``make hosts-up``; root only) gives every host
two NICs, as a GPU server has: a control (management) network that carries HTTP (the control
plane, the workers' registrations, heartbeats and command streams) and a data network for the
KV bytes between workers (NIXL/UCX)::

                                     control                       data
                             kvp-br0 10.77.0.254/24        kvp-br1 10.78.0.254/24
    namespace kvp-cp   eth0 10.77.0.1/24 ─┤           data0 10.78.0.1/24 ─┤
    namespace kvp-ctx  eth0 10.77.0.2/24 ─┤           data0 10.78.0.2/24 ─┤
    namespace kvp-gen  eth0 10.77.0.3/24 ─┘           data0 10.78.0.3/24 ─┘

Every NIC is one end of a veth pair; the other end, ``kvp-<host>-b`` (control) or ``kvp-<host>-d``
(data), is the host's "switch port" on that network's bridge. The root namespace keeps .254 on
each bridge so a driver (a test, a benchmark, an operator's shell) reaches every host; no host
uses 127.0.0.1 to reach another, and no host routes between the two networks. Nothing keeps UCX
off the control network but the workers' own setting: a worker started with
``--ucx-net-devices data0`` (``Fleet(ucx_net_devices="data0")``) uses only ``data0``; without it
UCX spreads its lanes over both NICs. Each namespace sets ``net.ipv4.tcp_retries2`` (default 3
here: an established TCP connection whose peer vanished fails after about 3 s instead of about
15 minutes), so UCX reports a dead peer within a test's patience.

Processes are started with ``ip netns exec`` (:meth:`Bed.command`), which also mounts the
namespace's own ``/sys``: UCX lists network devices under ``/sys/class/net``.
:meth:`Bed.counters` reads a NIC's byte and packet counters (how a test tells which network
carried a transfer).

Faults concern the data plane: each applies to one host's NIC on the **data** network unless
``network="control"`` names the control one (undone by :meth:`Bed.heal`):

- :meth:`Bed.loss`: nftables drops ``percent`` % of the host's packets to and from the network's
  subnet, in each direction (``numgen random mod 100 < N drop``), whichever device carries them;
- :meth:`Bed.rate`: ``tc tbf`` limits the NIC's egress bandwidth;
- :meth:`Bed.partition`: the host's switch port on that network goes down (``ip link set
  kvp-<host>-d down``): nothing reaches the NIC or leaves it, established connections stay open
  until TCP gives up; the other network carries on (a data partition leaves the heartbeats up);
- :meth:`Bed.delay`: traffic between two hosts' addresses on the network takes a detour through a
  user-space relay that holds every packet ``ms`` milliseconds (there is no netem here): each
  host gets a TUN device ``kvp-dly`` and a host route to the other host's address through it;
  the relay (:func:`relay`, its own process in the root namespace) reads IP packets from one TUN
  and writes them into the other when they are due. The TUN MTU is 64 KiB, so TCP sends few,
  large segments and Python keeps up. Everything else still goes over the NICs undelayed.
  :meth:`Bed.loss` of the same network applies to the detour as well.

A database a control plane in ``kvp-cp`` uses: SQLite (a file: namespaces share the file system)
or PostgreSQL through its Unix socket (``?host=/var/run/postgresql``): the server listens on the
root namespace's 127.0.0.1, which no other namespace can reach.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PREFIX = "kvp-"
HOSTS = {"cp": 1, "ctx": 2, "gen": 3}
DRIVER = 254  # the root namespace's host number on every network
TCP_RETRIES2 = 3
DELAY_DEVICE = "kvp-dly"
DELAY_MTU = 65000


class BedError(RuntimeError):
    """The bed cannot be built here (not root, no namespaces, a tool missing)."""


@dataclass(frozen=True)
class Network:
    """One of the bed's networks: a bridge in the root namespace and one NIC per host on it."""

    bridge: str
    subnet: str  # the first three octets of its /24
    device: str  # the NIC's name in every host
    tag: str  # a host's switch port on the bridge is kvp-<host>-<tag>


CONTROL, DATA = "control", "data"
NETWORKS = {
    CONTROL: Network(bridge="kvp-br0", subnet="10.77.0", device="eth0", tag="b"),
    DATA: Network(bridge="kvp-br1", subnet="10.78.0", device="data0", tag="d"),
}
DATA_DEVICE = NETWORKS[DATA].device  # what a worker pins: ``--ucx-net-devices data0``


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
    """The namespaces, their NICs and the bridges; :meth:`up`, faults, :meth:`down`.

    ``network`` arguments name ``"control"`` or ``"data"``: addresses default to the control
    network (where hosts reach each other's HTTP), NIC counters and faults to the data network
    (where the KV bytes go)."""

    hosts: Mapping[str, int] = field(default_factory=lambda: dict(HOSTS))
    tcp_retries2: int = TCP_RETRIES2
    _relays: dict[tuple[str, str], subprocess.Popen[bytes]] = field(default_factory=dict)

    def ns(self, host: str) -> str:
        return f"{PREFIX}{host}"

    def address(self, host: str, network: str = CONTROL) -> str:
        """``host``'s address on ``network``."""
        return f"{NETWORKS[network].subnet}.{self.hosts[host]}"

    def driver_address(self, network: str = CONTROL) -> str:
        """The root namespace's address on ``network`` (on its bridge)."""
        return f"{NETWORKS[network].subnet}.{DRIVER}"

    def device(self, network: str = DATA) -> str:
        """The name of every host's NIC on ``network`` (``eth0``, ``data0``)."""
        return NETWORKS[network].device

    def port(self, host: str, network: str = DATA) -> str:
        """The host's switch port on ``network``'s bridge (root namespace side of its veth)."""
        return f"{PREFIX}{host}-{NETWORKS[network].tag}"

    # --- building ----------------------------------------------------------------------------

    def up(self) -> Bed:
        """Build the bed (tearing down leftovers of an earlier one first)."""
        self.down()
        try:
            for name, net in NETWORKS.items():
                run("ip", "link", "add", net.bridge, "type", "bridge")
                run("ip", "addr", "add", f"{self.driver_address(name)}/24", "dev", net.bridge)
                run("ip", "link", "set", net.bridge, "up")
            for host in self.hosts:
                run("ip", "netns", "add", self.ns(host))
                self.exec(host, "ip", "link", "set", "lo", "up")
                for name, net in NETWORKS.items():
                    port = self.port(host, name)
                    run("ip", "link", "add", port, "type", "veth", "peer", "name", f"{port}i")
                    run("ip", "link", "set", f"{port}i", "netns", self.ns(host), "name", net.device)
                    run("ip", "link", "set", port, "master", net.bridge, "up")
                    address = f"{self.address(host, name)}/24"
                    self.exec(host, "ip", "addr", "add", address, "dev", net.device)
                    self.exec(host, "ip", "link", "set", net.device, "up")
                self.exec(host, "sysctl", "-q", "-w", f"net.ipv4.tcp_retries2={self.tcp_retries2}")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove every namespace and link this bed (or an earlier one) created."""
        self._stop_relays()
        for ns in run("ip", "netns", "list", check=False).split():
            if ns.startswith(PREFIX) and not ns.startswith(f"{PREFIX}probe"):
                run("ip", "netns", "del", ns, check=False)  # its veths (and their peers) go too
        for name, net in NETWORKS.items():
            run("ip", "link", "del", net.bridge, check=False)
            for host in self.hosts:
                run("ip", "link", "del", self.port(host, name), check=False)

    def exec(self, host: str, *argv: str, check: bool = True) -> str:
        return run("ip", "netns", "exec", self.ns(host), *argv, check=check)

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as it runs on ``host`` (for ``subprocess.Popen``)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def counters(self, host: str, network: str = DATA) -> dict[str, int]:
        """Bytes and packets through the host's NIC on ``network`` so far."""
        base = f"/sys/class/net/{self.device(network)}/statistics"
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

    def loss(self, host: str, percent: int, *, network: str = DATA) -> None:
        """Drop ``percent`` % of ``host``'s packets to and from ``network``, in each direction
        (nftables; on the NIC and on a :meth:`delay` detour alike: the rule matches the
        network's subnet, not a device)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"loss {percent} %: between 0 and 100")
        self._nft_clear(host, network)
        if percent == 0:
            return
        subnet = f"{NETWORKS[network].subnet}.0/24"
        # nft's numgen range is 0-99: "< 100" is refused, so all of it is an unconditional drop
        sample = "" if percent == 100 else f" numgen random mod 100 < {percent}"
        rules = (
            f"table inet kvp_loss_{network} {{\n"
            "  chain kvp_in {\n"
            "    type filter hook input priority 0; policy accept;\n"
            f'    iifname != "lo" ip saddr {subnet}{sample} drop\n'
            "  }\n"
            "  chain kvp_out {\n"
            "    type filter hook output priority 0; policy accept;\n"
            f'    oifname != "lo" ip daddr {subnet}{sample} drop\n'
            "  }\n"
            "}\n"
        )
        run("ip", "netns", "exec", self.ns(host), "nft", "-f", "-", input=rules)

    def rate(
        self,
        host: str,
        rate: str,
        *,
        burst: str = "1mb",
        latency: str = "50ms",
        network: str = DATA,
    ) -> None:
        """Limit the egress of ``host``'s NIC on ``network`` to ``rate`` (``tc tbf``, e.g.
        ``"1gbit"``)."""
        self.exec(
            host,
            "tc",
            "qdisc",
            "replace",
            "dev",
            self.device(network),
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst,
            "latency",
            latency,
        )

    def partition(self, host: str, *, network: str = DATA) -> None:
        """Cut ``host`` off ``network`` (its switch port there goes down)."""
        run("ip", "link", "set", self.port(host, network), "down")

    def reconnect(self, host: str, *, network: str = DATA) -> None:
        run("ip", "link", "set", self.port(host, network), "up")

    def delay(self, a: str, b: str, ms: float, *, network: str = DATA) -> None:
        """Delay every packet between hosts ``a`` and ``b`` on ``network`` by ``ms`` (each
        way)."""
        self._stop_relays()
        argv = [
            sys.executable,
            "-m",
            "workers.testing.netbed",
            "relay",
            "--ms",
            str(ms),
            self.ns(a),
            self.address(a, network),
            self.ns(b),
            self.address(b, network),
        ]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert process.stdout is not None
        ready = process.stdout.readline()
        if ready.strip() != b"ready":
            process.kill()
            _, err = process.communicate(timeout=10)
            raise BedError(f"the delay relay did not start: {err.decode(errors='replace')}")
        self._relays[(a, b)] = process

    def _stop_relays(self) -> None:
        for process in self._relays.values():
            process.terminate()  # its TUN devices go with its file descriptors
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
            for pipe in (process.stdout, process.stderr):
                if pipe is not None:
                    pipe.close()
        self._relays.clear()

    def heal(self, host: str | None = None) -> None:
        """Undo every fault on ``host`` (every host when None; a delay always), on both
        networks."""
        self._stop_relays()
        for name in [host] if host else list(self.hosts):
            for network in NETWORKS:
                self._nft_clear(name, network)
                self.exec(
                    name, "tc", "qdisc", "del", "dev", self.device(network), "root", check=False
                )
                with contextlib.suppress(BedError):
                    self.reconnect(name, network=network)
            self.tcp_retries(name, self.tcp_retries2)

    def _nft_clear(self, host: str, network: str) -> None:
        self.exec(host, "nft", "delete", "table", "inet", f"kvp_loss_{network}", check=False)


def _open_tun(name: str) -> int:
    import fcntl
    import struct

    tunsetiff, iff_tun, iff_no_pi = 0x400454CA, 0x0001, 0x1000
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, tunsetiff, struct.pack("16sH", name.encode(), iff_tun | iff_no_pi))
    return fd


def relay(ms: float, a: tuple[str, str], b: tuple[str, str]) -> None:
    """Two TUN devices, one per namespace, each with a host route to the other side; every IP
    packet read from one is written into the other ``ms`` later (FIFO: a constant delay keeps
    the order). Runs until killed; prints ``ready`` once traffic flows through it."""
    fds = []
    for i, ((ns, address), (_, other)) in enumerate(((a, b), (b, a))):
        name = f"{DELAY_DEVICE}{i}"
        fds.append(_open_tun(name))
        run("ip", "link", "set", name, "netns", ns)
        in_ns = ("ip", "netns", "exec", ns)
        run(*in_ns, "ip", "link", "set", name, "name", DELAY_DEVICE)
        run(*in_ns, "ip", "link", "set", DELAY_DEVICE, "mtu", str(DELAY_MTU), "up")
        run(*in_ns, "ip", "route", "replace", f"{other}/32", "dev", DELAY_DEVICE, "src", address)
        for key in (f"net.ipv4.conf.{DELAY_DEVICE}.rp_filter", "net.ipv4.conf.all.rp_filter"):
            run(*in_ns, "sysctl", "-q", "-w", f"{key}=0")
    print("ready", flush=True)
    delay = ms / 1000.0
    queue: deque[tuple[float, int, bytes]] = deque()
    peer = {fds[0]: fds[1], fds[1]: fds[0]}
    while True:
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else None
        readable, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            for _ in range(64):  # drain a burst, without starving the other direction
                try:
                    packet = os.read(fd, DELAY_MTU + 64)
                except BlockingIOError:
                    break
                queue.append((now + delay, peer[fd], packet))
                if not select.select([fd], [], [], 0)[0]:
                    break
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, out, packet = queue.popleft()
            with contextlib.suppress(OSError):  # a full queue drops, like a wire
                os.write(out, packet)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.testing.netbed",
        description="Network-namespace hosts for kvplane tests.",
    )
    parser.add_argument("action", choices=["up", "down", "status", "relay"])
    parser.add_argument("--ms", type=float, default=5.0, help="relay: the delay each way")
    parser.add_argument("relay_args", nargs="*", help="relay: NS_A ADDR_A NS_B ADDR_B")
    args = parser.parse_intermixed_args(argv)
    if args.action == "relay":
        ns_a, addr_a, ns_b, addr_b = args.relay_args
        relay(args.ms, (ns_a, addr_a), (ns_b, addr_b))
        return 0
    bed = Bed()
    if args.action == "up":
        why = available()
        if why:
            print(f"cannot build the bed: {why}", file=sys.stderr)
            return 1
        bed.up()
        control, data = NETWORKS[CONTROL], NETWORKS[DATA]
        for host in bed.hosts:
            print(
                f"{bed.ns(host):8} {control.device} {bed.address(host, CONTROL):10} "
                f"{data.device} {bed.address(host, DATA):10} (ip netns exec {bed.ns(host)} ...)"
            )
        for name, net in NETWORKS.items():
            print(f"driver   {bed.driver_address(name)} on {net.bridge} ({name})")
    elif args.action == "down":
        bed.down()
        print("bed removed")
    else:
        print(run("ip", "netns", "list", check=False) or "no namespaces")
    return 0


if __name__ == "__main__":
    sys.exit(main())
