"""The stall watch (``workers/watchdog.py``): a late beat that is due dumps every thread's stack
once, and a thread that keeps the GIL still gets the stacks dumped by the interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from workers.watchdog import ENV, StallWatch, stall_dump_s


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [(None, None), ("", None), ("0", None), ("-3", None), ("x", None), ("2.5", 2.5)],
)
def test_the_delay_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, seconds: float | None
) -> None:
    if raw is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, raw)
    assert stall_dump_s() == seconds


def test_a_late_beat_dumps_every_thread_once_and_again_after_it_moved(tmp_path: Path) -> None:
    with (tmp_path / "dump.txt").open("w+") as out:
        text, dumps = _two_stalls(out)
    assert dumps == 2
    assert text.count("kvplane stall watch (rank-0): the loop stopped for more than 1 s") == 2
    assert "_two_stalls" in text  # this thread's stack
    assert "in wait" in text  # the bystander's, parked in Event.wait


def _two_stalls(out: Any) -> tuple[str, int]:
    moved = {"at": time.monotonic() - 5.0}
    due = {"now": True}
    parked = threading.Event()
    bystander = threading.Thread(target=parked.wait, name="bystander", daemon=True)
    bystander.start()
    watch = StallWatch("rank-0", 1.0, out=out)
    watch.watch("the loop", lambda: moved["at"], lambda: due["now"])
    try:
        assert watch.look() == ["the loop"]
        assert watch.look() == []  # still late: no second dump
        moved["at"] = time.monotonic()
        assert watch.look() == []
        moved["at"] = time.monotonic() - 5.0
        due["now"] = False  # late, but nothing is outstanding: not a stall
        assert watch.look() == []
        due["now"] = True
        assert watch.look() == ["the loop"]
    finally:
        parked.set()
    out.seek(0)
    return out.read(), watch.dumps


def test_a_beat_that_raises_is_not_late(tmp_path: Path) -> None:
    def gone() -> float:
        raise AttributeError("the handover went away")

    with (tmp_path / "d").open("w") as out:
        watch = StallWatch("rank-0", 0.1, out=out)
        watch.watch("gone", gone, lambda: True)
        assert watch.look() == []


def test_a_thread_that_keeps_the_gil_still_gets_the_stacks_dumped() -> None:
    # libc's sleep through ctypes.PyDLL keeps the GIL: no Python thread, the watch's included,
    # runs until it returns; the interpreter's own C thread dumps the stacks.
    script = textwrap.dedent(
        """
        import ctypes, time
        from workers.watchdog import StallWatch
        watch = StallWatch("rank-0", 0.4).start()
        time.sleep(1.5)  # the watch looks (and re-arms) at least once
        ctypes.PyDLL(None).sleep(3)
        watch.stop()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert "Timeout (0:00:00.800000)!" in done.stderr, done.stderr
    assert "kvplane-stallwatch" in done.stderr or "Thread 0x" in done.stderr, done.stderr
