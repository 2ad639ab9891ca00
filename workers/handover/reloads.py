"""Peers whose connection failed: probed off the progress thread, reloaded once they answer.

When UCX fails a connection, everything later sent over it is lost, so the peer must be
loaded again (``remove_remote_agent``, then ``add_remote_agent``) before the next transfer. Doing
that on the handover's progress thread the moment the failure shows has two costs:

- while the peer is still unreachable (a network cut), NIXL's metadata load blocks for as long
  as the network takes to refuse (about 3 s per try on a host that stopped answering ARP), and
  no handle of this rank can fail or finish meanwhile;
- dropping an agent while WRITEs to it are posted, or its notifications unread, hands UCX
  requests whose endpoint is gone (a progress call crashed in ``libuct`` after such a reload).

:class:`PeerReloads` keeps the peers that failed. A watch thread probes each with an agent of its
own (:meth:`~workers.transport.nixl.NixlTransport.probe_peer`; nothing of the rank's endpoint
waits on it), every 0.25 s at first and up to every 2 s. Once a probe succeeds the peer is
*ready*; the progress thread reloads it at its next step, after it read every notification, and
only when no WRITE to it is posted. Until then routes toward the peer wait, and fail at their
own deadline with the reason the connection failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.transport.nixl import NixlTransport

log = logging.getLogger("kvplane.handover")

# What a probe that reached a peer tells it: load this rank again too. One side's failed
# connection can leave the other side's endpoint half dead (its messages lost without an error),
# so both sides start over.
RELOAD_ME = b"kvplane-reload|"
PROBE_FIRST_S = 0.25  # first probe this long after the failure, then twice as long each time
PROBE_MAX_S = 2.0


@dataclass
class Stale:
    """A peer whose connection failed, until it is loaded again."""

    since: float
    error: str
    next_probe: float
    backoff: float
    probes: int = 0
    ready: bool = False  # the last probe reached it: reload at the next step
    asked: bool = True  # the probe asks the peer to load this rank again too


class PeerReloads:
    """The failed peers of one rank, and the thread that probes them."""

    def __init__(
        self,
        transport: NixlTransport,
        wake: Callable[[], None],
        name: str,
        info_of: Callable[[str], Mapping[str, Any] | None],
    ) -> None:
        self.transport = transport
        self.wake = wake  # wakes the progress thread (a peer became ready)
        self.info_of = info_of  # a peer's published endpoint, by agent name
        self.name = name
        self._stale: dict[str, Stale] = {}
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.reloaded: dict[str, float] = {}  # agent: when it was last loaded again
        self._any_ready = False

    def mark(self, agent: str, error: BaseException | str, reload_failed: bool = False) -> None:
        """``agent``'s connection failed: stop using it until a probe reaches it. Another
        failure of the same connection before the reload changes nothing (the reload replaces
        it); ``reload_failed``: the reload itself failed, probe again."""
        now = time.monotonic()
        text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
        with self._lock:
            stale = self._stale.get(agent)
            if stale is None:
                self._stale[agent] = Stale(now, text, now + PROBE_FIRST_S, PROBE_FIRST_S)
                log.warning(
                    "peer %s unreachable (%s); probing it off the progress thread", agent, text
                )
            elif reload_failed:
                stale.error = text
                stale.ready = False
                stale.asked = True
                stale.next_probe = now + stale.backoff
                self._any_ready = any(s.ready for s in self._stale.values())
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._watch, daemon=True, name=f"kvplane-reloads-{self.name}"
                )
                self._thread.start()
        self._event.set()

    def requested(self, agent: str) -> None:
        """``agent`` reached this rank with a probe after its connection to this rank failed:
        load it again at the next step (it answered, no probe needed)."""
        if self.info_of(agent) is None:
            return  # not a peer of this rank (or retired)
        now = time.monotonic()
        with self._lock:
            stale = self._stale.get(agent)
            if stale is None:
                stale = self._stale[agent] = Stale(
                    now, "the peer asked for a new connection", now, PROBE_FIRST_S
                )
            stale.ready = True
            stale.asked = False  # reloaded on request: do not ask it back
            self._any_ready = True
        log.info("peer %s asked for a new connection", agent)
        self.wake()

    def stale(self, agent: str) -> Stale | None:
        """The failure that keeps ``agent`` out of use, or None."""
        return self._stale.get(agent)

    def why(self, agent: str) -> str | None:
        """Why routes toward ``agent`` wait: since when and the error, or None."""
        stale = self._stale.get(agent)
        if stale is None:
            return None
        return (
            f"unreachable for {time.monotonic() - stale.since:.1f} s "
            f"({stale.probes} probe(s) since): {stale.error}"
        )

    @property
    def any_ready(self) -> bool:
        """Whether a probe reached a failed peer (no lock: the progress thread asks every step)."""
        return self._any_ready

    def ready(self) -> list[str]:
        """Peers a probe reached since they failed: reload them now."""
        with self._lock:
            return [agent for agent, stale in self._stale.items() if stale.ready]

    def done(self, agent: str) -> None:
        """``agent`` was loaded again: usable."""
        with self._lock:
            stale = self._stale.pop(agent, None)
            self._any_ready = any(s.ready for s in self._stale.values())
        self.reloaded[agent] = time.monotonic()
        if stale is not None:
            log.info(
                "peer %s loaded again after %.1f s (%d probe(s))",
                agent,
                time.monotonic() - stale.since,
                stale.probes,
            )

    def forget(self, agent: str) -> None:
        """``agent`` was retired (its rank has another worker now): stop probing it."""
        with self._lock:
            self._stale.pop(agent, None)
            self._any_ready = any(s.ready for s in self._stale.values())
        self.reloaded.pop(agent, None)

    def close(self) -> None:
        self._closed = True
        self._event.set()

    def _watch(self) -> None:
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                due = [
                    agent
                    for agent, stale in self._stale.items()
                    if not stale.ready and stale.next_probe <= now
                ]
                waits = [s.next_probe - now for s in self._stale.values() if not s.ready]
            for agent in due:
                if self._closed:
                    return
                info = self.info_of(agent)
                stale = self._stale.get(agent)
                note = RELOAD_ME + self.transport.name.encode() if stale and stale.asked else None
                error = "retired" if info is None else self.transport.probe_peer(info, note)
                with self._lock:
                    stale = self._stale.get(agent)
                    if stale is None:
                        continue
                    stale.probes += 1
                    if error is None:
                        stale.ready = True
                        self._any_ready = True
                    else:
                        stale.error = error
                        stale.backoff = min(PROBE_MAX_S, stale.backoff * 2)
                        stale.next_probe = time.monotonic() + stale.backoff
                if error is None:
                    self.wake()
            self._event.wait(max(0.01, min(waits, default=1.0)) if not due else 0.01)
            self._event.clear()
