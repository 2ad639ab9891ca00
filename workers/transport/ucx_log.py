"""What UCX actually uses for an endpoint's peer connections, read from UCX's own log.

``ucx_tls`` and ``ucx_net_devices`` are the set UCX chooses from; per peer it picks lanes, and
between two processes of one kernel it picks shared memory (``cma/memory``) over the network
unless ``UCX_TLS`` rules it out. At ``UCX_LOG_LEVEL=info``, UCX (1.23) logs one line per endpoint
configuration it builds::

    [1796145928.294178] [vm:13684:0]  ucp_worker.c:1997 UCX  INFO    a intra-node cfg#1 \
rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)

the UCX worker's name (the NIXL agent's, cut to 31 characters), the peer's scope (``self``, the
loopback to itself and no peer, ``intra-node`` or ``inter-node``), the configuration's index and
its lanes by kind, each a list of ``transport/device``: ``rma`` and ``amo`` (``_am``: emulated over
active messages), ``am`` (active messages, and the bandwidth lanes that carry large messages: the
bytes of a big WRITE), ``tag``, ``stream``, ``ka`` (keep-alive).

UCX reads its log options once, when the library loads (NIXL's UCX plugin, at the process's first
agent), so :func:`setup` runs before that: unless the user set ``UCX_LOG_LEVEL`` or
``UCX_LOG_FILE`` (then their logging is left alone and the report is unknown), it sets both, at
info level, to ``$TMPDIR/kvplane-ucx.<pid>.log`` (``UCX_LOG_FILE_SIZE`` 1 MiB: UCX starts the file
over when full; a few hundred bytes per agent and per endpoint configuration otherwise), removed
at exit. A child process inherits the setting and writes its own file. UCX writes the file through
a buffered C stream: :class:`UcxLog` flushes the process's C streams before it reads the new
bytes. Reading and parsing happen off the hot path (a worker's heartbeat thread); a missing file
or a line of an unknown format is never an error, only an unknown (``None``) report.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import tempfile
import threading
from collections import deque
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import IO, Any

LOG_NAME = "kvplane-ucx.%p.log"  # UCX replaces %p with the process id
LOG_FILE_SIZE = "1m"
WORKER_NAME_MAX = 31  # UCX cuts a worker's name to this many characters
SHARED_MEMORY_DEVICE = "memory"  # cma, knem, xpmem, posix, sysv: no network
READ_MAX_BYTES = 1 << 20  # per refresh; the rest waits for the next one
LINE_MAX_BYTES = 1 << 14
CONFIGS_KEPT = 4096

_CONFIG = re.compile(
    r"\bUCX\s+INFO\s+(?P<name>\S+)\s+(?P<scope>self|intra-node|inter-node)\s+cfg#\d+\s+"
    r"(?P<lanes>.*\S)\s*$"
)
_LANE = re.compile(r"([a-z_]+)\(([^()]*)\)")
_SETUP_LOCK = threading.Lock()
_log: UcxLog | None = None


@dataclass(frozen=True)
class EndpointConfig:
    """One endpoint configuration UCX logged: its worker, the peer's scope and its lanes."""

    worker: str
    scope: str  # "self" | "intra-node" | "inter-node"
    lanes: tuple[tuple[str, tuple[str, ...]], ...]  # (kind, ("tcp/lo", "cma/memory")), ...
    at: int = 0  # where the line starts in the log (bytes read before it)

    def names(self, agent: str) -> bool:
        """Whether this is ``agent``'s configuration (UCX cuts long names)."""
        return self.worker == agent or (
            len(self.worker) >= WORKER_NAME_MAX and agent.startswith(self.worker)
        )


def parse_line(line: str, at: int = 0) -> EndpointConfig | None:
    """An endpoint configuration from one line of UCX's log (None: any other line)."""
    match = _CONFIG.search(line)
    if match is None:
        return None
    text = match["lanes"]
    lanes = _LANE.findall(text)
    if not lanes or _LANE.sub("", text).strip():
        return None  # something besides lanes: a format this parser does not know
    return EndpointConfig(
        match["name"], match["scope"], tuple((kind, tuple(tls.split())) for kind, tls in lanes), at
    )


def summarize(configs: Iterable[EndpointConfig]) -> dict[str, Any] | None:
    """What the peer connections of ``configs`` use (``self`` skipped; None: no connection):
    ``transports`` (every ``transport/device`` on a lane), ``lanes`` by kind, ``peers`` (the
    scopes) and ``shared_memory`` (a lane on shared memory, i.e. bytes that skip the network)."""
    lanes: dict[str, list[str]] = {}
    transports: list[str] = []
    peers: list[str] = []
    for config in configs:
        if config.scope == "self":
            continue
        if config.scope not in peers:
            peers.append(config.scope)
        for kind, tls in config.lanes:
            kept = lanes.setdefault(kind, [])
            for tl in tls:
                if tl not in kept:
                    kept.append(tl)
                if tl not in transports:
                    transports.append(tl)
    if not peers:
        return None
    return {
        "transports": transports,
        "lanes": lanes,
        "peers": peers,
        "shared_memory": any(tl.split("/", 1)[-1] == SHARED_MEMORY_DEVICE for tl in transports),
    }


def _flush_c_streams() -> None:
    """Write out what UCX's log stream holds (stdio buffers it; UCX flushes only on errors)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


class UcxLog:
    """UCX's log file of this process, read incrementally: each call reads only new bytes."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self._inode: int | None = None
        self._partial = b""
        self._read = 0  # bytes consumed, over every file UCX started
        self._configs: deque[EndpointConfig] = deque(maxlen=CONFIGS_KEPT)

    def mark(self) -> int:
        """Where the log stands now: :meth:`report` ``since`` it skips what came before."""
        with self._lock:
            self._refresh()
            return self._read - len(self._partial)  # a line being written counts as after

    def report(self, agent: str, *, since: int = 0) -> dict[str, Any] | None:
        """What ``agent``'s peer connections use (:func:`summarize`), from configurations
        logged after ``since``; None when unknown. Never raises."""
        try:
            with self._lock:
                self._refresh()
                configs = [c for c in self._configs if c.at >= since and c.names(agent)]
            return summarize(configs)
        except Exception:
            return None

    def close(self) -> None:
        """Stop reading (the file stays: UCX may still write to it)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _refresh(self) -> None:
        if self.path is None:
            return
        _flush_c_streams()
        try:
            inode = os.stat(self.path).st_ino
        except OSError:
            inode = None
        if self._file is not None and inode != self._inode:
            self._consume(self._file.read(READ_MAX_BYTES))  # the rest of the file UCX left
            self._file.close()
            self._file, self._partial = None, b""
        if self._file is None:
            if inode is None:
                return
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 (kept open between reads)
            except OSError:
                return
            self._inode = os.fstat(self._file.fileno()).st_ino
        self._consume(self._file.read(READ_MAX_BYTES))

    def _consume(self, data: bytes) -> None:
        if not data:
            return
        start = self._read - len(self._partial)
        self._read += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > LINE_MAX_BYTES:
            self._partial = b""  # not a line this parser wants
        for raw in lines:
            config = parse_line(raw.decode("utf-8", "replace"), start)
            if config is not None:
                self._configs.append(config)
            start += len(raw) + 1


def setup(environ: MutableMapping[str, str] = os.environ) -> UcxLog:
    """This process's UCX log (call before the first NIXL agent; later calls return it)."""
    global _log
    with _SETUP_LOCK:
        if _log is None:
            _log = UcxLog(_configure(environ))
            atexit.register(_log.close)
        return _log


def _configure(environ: MutableMapping[str, str]) -> str | None:
    """Point UCX's log at a file of this process unless the user set UCX's logging; the file's
    path (None: the user's logging, left alone)."""
    level, file = environ.get("UCX_LOG_LEVEL"), environ.get("UCX_LOG_FILE")
    if level is None and file is None:
        level, file = "info", os.path.join(tempfile.gettempdir(), LOG_NAME)
        environ["UCX_LOG_LEVEL"], environ["UCX_LOG_FILE"] = level, file
        environ.setdefault("UCX_LOG_FILE_SIZE", LOG_FILE_SIZE)
    elif file is None or os.path.basename(file) != LOG_NAME or level != "info":
        return None  # not ours (a parent kvplane process sets exactly these, children inherit)
    path = file.replace("%p", str(os.getpid()))
    with contextlib.suppress(OSError):
        os.unlink(path)  # an earlier process's with this pid
    atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
