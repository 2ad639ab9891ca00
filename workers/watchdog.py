"""A rank's stall watch: when its work stops moving, every thread's stack goes to stderr.

Off unless the engine's environment sets ``KVPLANE_STALL_DUMP_S`` to a number of seconds. A
:class:`StallWatch` then runs one thread that looks, once a second, at the beats it was told to
watch: each is the time something last moved (the handover's progress loop, the engine's step)
and a test of whether it should be moving now (a step is only due while the rank has work
outstanding). A beat late by more than that many seconds while due gets one dump of every
thread's stack, and another only after it moved again.

A thread stuck in a C call that keeps the GIL stops every Python thread, this one included, so
the watch also re-arms :func:`faulthandler.dump_traceback_later` at twice the delay on every
look: the interpreter's own C thread then dumps the stacks if the watch itself stops looking.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("kvplane.watchdog")

ENV = "KVPLANE_STALL_DUMP_S"
LOOK_S = 1.0


def stall_dump_s() -> float | None:
    """The delay ``KVPLANE_STALL_DUMP_S`` asks for; None when unset, empty, 0 or not a number
    (the latter said once in the log)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds: the stall watch stays off", ENV, raw)
        return None
    return seconds if seconds > 0 else None


class StallWatch:
    """Dumps every thread's stack when a watched beat is late (see the module docstring)."""

    def __init__(self, name: str, after_s: float, *, out: TextIO | None = None) -> None:
        self.name = name
        self.after_s = after_s
        self.out = out or sys.stderr
        self.dumps = 0  # stack dumps written so far
        self._beats: dict[str, tuple[Callable[[], float], Callable[[], bool]]] = {}
        self._late: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"kvplane-stallwatch-{name}"
        )

    def watch(self, what: str, last: Callable[[], float], due: Callable[[], bool]) -> None:
        """Watch ``last()`` (a :func:`time.monotonic` time) while ``due()`` says it should move."""
        self._beats[what] = (last, due)

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * LOOK_S)

    def look(self) -> list[str]:
        """One look: the beats newly late (each dumped once)."""
        now = time.monotonic()
        newly = []
        for what, (last, due) in list(self._beats.items()):
            try:
                late = now - last() > self.after_s and due()
            except Exception:  # a watched object going away must not stop the watch
                late = False
            if not late:
                self._late.discard(what)
            elif what not in self._late:
                self._late.add(what)
                newly.append(what)
        if newly:
            self.dump(f"{', '.join(newly)} stopped for more than {self.after_s:g} s")
        return newly

    def dump(self, why: str) -> None:
        self.dumps += 1
        print(f"kvplane stall watch ({self.name}): {why}; every thread:", file=self.out, flush=True)
        faulthandler.dump_traceback(file=self.out, all_threads=True)
        self.out.flush()

    def _run(self) -> None:
        try:
            while not self._stop.wait(LOOK_S):
                faulthandler.dump_traceback_later(2 * self.after_s, file=self.out)
                self.look()
        finally:
            faulthandler.cancel_dump_traceback_later()
