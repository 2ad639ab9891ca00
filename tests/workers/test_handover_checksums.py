"""A verified receive compares each route's crc32 with the one its sender's last notification
carried, before the handle says arrived."""

from __future__ import annotations

from types import SimpleNamespace

from workers.handover.handles import checksum_mismatch
from workers.handover.notices import decode, notice


def route(sender: int, checksum: int | None, told: int | None) -> SimpleNamespace:
    return SimpleNamespace(
        sender_rank=sender, receiver_rank=0, checksum=checksum, sender_checksum=told
    )


def test_a_route_whose_sums_differ_fails_the_receive_naming_both() -> None:
    assert checksum_mismatch([route(0, 7, 7), route(1, 9, 9)]) is None  # type: ignore[list-item]
    assert checksum_mismatch([route(0, 7, None), route(1, 9, None)]) is None  # type: ignore[list-item]
    assert (
        checksum_mismatch([route(0, 7, 7), route(1, 9, 8)])  # type: ignore[list-item]
        == "checksum_mismatch: route 1->0: sender crc32 8, receiver crc32 9"
    )


def test_the_senders_sum_rides_the_last_field_of_its_notifications() -> None:
    kind, key, fields = decode(notice("F", "x.1", "ce", "ge", 3, 1, 4096, 12345))  # type: ignore[misc]
    assert (kind, key, fields[6:]) == ("F", ("x.1", 3, 1), ["4096", "12345"])
    kind, key, fields = decode(notice("C", "x.1", "ce", "ge", 3, 1, 1, 2, 777))  # type: ignore[misc]
    assert (kind, int(fields[6]), int(fields[7]), int(fields[8])) == ("C", 1, 2, 777)
