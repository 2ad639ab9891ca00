"""The staging buffer a receiver grants from and a writer gathers into: the credit a grant
hands out.

Staged mode moves a route in chunks of ``CHUNK_BLOCKS`` blocks through one contiguous area of each
side's staging buffer. :class:`StagingAreas` hands out first-fit areas (256-byte aligned) and
takes them back. The area of a failed transfer is quarantined for the grant's time to live plus
a margin instead of freed: a writer never starts a WRITE after its grant expired, so a late
WRITE never lands in an area that another transfer owns.
"""

from __future__ import annotations

CHUNK_BLOCKS = 16
_ALIGN = 256


class StagingAreas:
    """First-fit allocator over one staging buffer, with quarantine for areas a late WRITE may
    still hit."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (start, end)
        self._quarantined: list[tuple[float, int, int]] = []

    def alloc(self, nbytes: int) -> int | None:
        need = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        for i, (start, end) in enumerate(self._free):
            if end - start >= need:
                if end - start == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, end)
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        end = start + max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        self._free.append((start, end))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, e in self._free:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        self._free = merged

    def quarantine(self, start: int, nbytes: int, until: float) -> None:
        self._quarantined.append((until, start, nbytes))

    def reclaim(self, now: float) -> None:
        if not self._quarantined:
            return
        keep = []
        for until, start, nbytes in self._quarantined:
            if until <= now:
                self.free(start, nbytes)
            else:
                keep.append((until, start, nbytes))
        self._quarantined = keep

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in self._free)
