"""Notifications between the two sides of a route, and their wire format.

Every message rides a NIXL notification: ``|``-separated ASCII, ``x`` the transfer id, ``ce``/``ge``
the context and generation epochs the sender and receiver planned with, ``s``/``r`` the route's
ranks (``(x, s, r)`` is the route's key on both sides):

- ``G|x|ce|ge|s|r|offset|nbytes|chunk_blocks|ttl_ms[|1]``: receiver → writer, "write this route
  into my staging at ``offset``" (``offset`` -1: fragments mode, straight into the pools); the
  trailing ``1`` (a verified route): "I compare your crc32 with mine";
- ``C|x|ce|ge|s|r|i|n[|crc]``: writer → receiver with the WRITE of chunk ``i`` of ``n``; the last
  chunk of a verified route carries the writer's crc32 of the route;
- ``F|x|ce|ge|s|r|nbytes[|crc]``: writer → receiver with the fragments WRITE (and, verified, the
  writer's crc32 of the route, summed before the WRITE);
- ``X|x|ce|ge|s|r|reason``: either way, "this transfer failed here";
- ``A|x|ce|ge|s|r|json``: receiver → writer before its grant, "send this request" (see
  :class:`Ask`);
- ``P|x|ce|ge|s|r``: writer → receiver, a probe of a connection that may have lost a WRITE;
- ``R|x|ce|ge|s|r``: receiver → writer, "I will not ask for ``x`` (the writer's request id):
  free its blocks now" (an engine's release notice; see :meth:`Handover.release`).

A verified receive compares each route's crc32 with its writer's before its handle says
``arrived``: a difference fails it (``checksum_mismatch``) while the engine can still refuse the
blocks, and the writer's released handle, whose sum the receiver already had, is not recorded.
A writer that sends no sum (an older one) is compared on the control plane from its record.

A receiver whose granted route hears nothing for ``GRANT_RESEND_S`` sends its grant again (a
writer ignores a grant it already has). Lost connections: when NIXL says the connection to a peer
failed (a WRITE in its error state, ``nixlRemoteDisconnectError``), every handle using it fails as
``peer_unreachable``, the peer is loaded again (a new connection: UCX loses whatever is sent over
a failed one, silently) and the abort goes over the new one. The re-sent grant is what finds a
connection that failed while it was idle, so the next transfer after a network outage works
instead of waiting for its deadline. A writer that gets a grant again for a route it already
wrote (UCX completes a TCP WRITE once the bytes are in the socket) probes the connection with a
``P`` notification; when that finds the connection failed, the bytes were lost with it and the
receiver gets a ``peer_unreachable`` abort over a new one. On a merely slow link the probe is
harmless and the bytes arrive.

This module only encodes and decodes; who sends what when is :mod:`workers.handover.grants`
and :mod:`workers.handover.handles`, and :mod:`workers.handover.engine_api` dispatches what
arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: A route on both sides: ``(transfer id, sender rank, receiver rank)``.
RouteKey = tuple[str, int, int]


def notice(*parts: object) -> bytes:
    """One notification: its fields joined by ``|``."""
    return "|".join(str(p) for p in parts).encode()


def decode(msg: bytes) -> tuple[str, RouteKey, list[str]] | None:
    """``(kind, route key, fields)`` of a notification; None when it is not one of ours (or
    mangled): nothing waits for it."""
    try:
        fields = msg.decode("ascii").split("|")
        kind = fields[0]
        key = (fields[1], int(fields[4]), int(fields[5]))
    except (UnicodeDecodeError, IndexError, ValueError):
        return None
    return kind, key, fields


def reason_field(reason: str) -> str:
    """A failure reason as the last field of an ``X`` notification."""
    return reason[:200].replace("|", "/")


@dataclass(frozen=True)
class Ask:
    """A generation rank's request that this context rank send ``request_id``.

    Engines whose context side finishes a request before the generation side has allocated its
    blocks (vLLM, SGLang: the prefill engine answers, then a router sends the request to the
    decode engine) cannot call ``send`` with both block lists. The generation rank then calls
    ``expect(..., ask=True)``: before its grant it sends each writer an ``A`` notification with
    the request's block map and options, and the context rank's ``on_ask`` hook answers with
    :meth:`Handover.send` (the engine checks that it still holds the blocks) or
    :meth:`Handover.refuse`. An ask comes again with each re-sent grant until a send starts; a
    request id that was already sent or refused here is ignored.
    """

    agent: str
    peer: str  # the generation instance
    peer_rank: int
    request_id: str
    blocks: Mapping[str, Any]  # the REST form, both sides' lists
    context_dp_rank: int | None
    generation_dp_rank: int | None
    timeout_s: float  # what is left of the receiver's deadline
    mode: str
    verify: bool
    epochs: tuple[str, str]
    route: tuple[int, int]  # (sender rank, receiver rank)
    num_tokens: int | None = None
    # The context engine's own id of the request whose blocks to send, when the transfer's id
    # (``request_id``, the generation engine's) differs from it; None: the same id.
    source: str | None = None

    def send_options(self) -> dict[str, Any]:
        """Keyword arguments of :meth:`Handover.send` that match the receiver's."""
        return {
            "context_dp_rank": self.context_dp_rank,
            "generation_dp_rank": self.generation_dp_rank,
            "timeout_s": self.timeout_s,
            "mode": self.mode,
            "verify": self.verify,
            "num_tokens": self.num_tokens,
        }


def ask_payload(
    *,
    request_id: str,
    blocks: Any,
    dp: tuple[int | None, int | None],
    mode: str,
    verify: bool,
    num_tokens: int | None,
    timeout_s: float,
    source: str | None = None,
) -> str:
    """The JSON field of an ``A`` notification."""
    return json.dumps(
        {
            "q": request_id,
            "b": blocks,
            "cdp": dp[0],
            "gdp": dp[1],
            "m": mode,
            "v": verify,
            "n": num_tokens,
            "t": round(max(0.001, timeout_s), 3),
            **({"src": source} if source is not None else {}),
        },
        separators=(",", ":"),
    )


def parse_ask(agent: str, peer: str, peer_rank: int, fields: list[str]) -> Ask:
    """The :class:`Ask` of an ``A`` notification from ``agent`` (a worker of ``peer`` rank
    ``peer_rank``); raises ``ValueError``, ``KeyError`` or ``TypeError`` when it is malformed."""
    body: Mapping[str, Any] = json.loads("|".join(fields[6:]))
    return Ask(
        agent=agent,
        peer=peer,
        peer_rank=peer_rank,
        request_id=str(body["q"]),
        blocks=dict(body["b"]),
        context_dp_rank=body.get("cdp"),
        generation_dp_rank=body.get("gdp"),
        timeout_s=float(body["t"]),
        mode=str(body.get("m", "auto")),
        verify=bool(body.get("v", False)),
        epochs=(fields[2], fields[3]),
        route=(int(fields[4]), int(fields[5])),
        num_tokens=None if body.get("n") is None else int(body["n"]),
        source=None if body.get("src") is None else str(body["src"]),
    )
