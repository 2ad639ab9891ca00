"""What crosses the engine boundary of kvplane's connectors, checked: a prefill's params (with
its prompt's chained block digests), the decode's own transfer ids, the prefill's answer to an
ask, and pairings made off the engine's thread. Nothing here imports an engine: the vLLM
connector (:mod:`workers.connectors.vllm`) uses it, and so could another engine's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from workers.handover.engine_api import REQUEST_ID

log = logging.getLogger("kvplane.vllm")

PAIRING_RETRY_S = 1.0  # a decode pairs with a prefill it could not reach again after this
REFUSED_RETRY_S = 30.0  # ... and with one the control plane found incompatible after this
MAX_BLOCKS = 1 << 20  # more remote block ids than any engine's cache holds: malformed
MAX_GROUPS = 64  # KV cache groups of one model, at most
DIGEST_CHARS = 16  # each block's chained digest: 64 bits, as hex
#: Test-only fault injection (``kvplane_fault_*`` request params, ``fault_skip_blocks``): these
#: act only in an engine started with this variable set to 1.
FAULTS_ENV = "KVPLANE_TEST_FAULTS"
T = TypeVar("T")
_HEX = re.compile(rf"^[0-9a-f]{{{DIGEST_CHARS}}}$")


def faults_enabled() -> bool:
    """Whether this process may act on test-only fault injection (``KVPLANE_TEST_FAULTS=1``)."""
    return os.environ.get(FAULTS_ENV) == "1"


def control_plane_token(extra: Mapping[str, Any]) -> str | None:
    """The control plane's bearer token: ``KVPLANE_TOKEN``, else the file ``token_file`` names.

    A ``token`` in ``kv_connector_extra_config`` is refused: vLLM logs its whole config at
    start-up, so the secret would be in every log."""
    if extra.get("token"):
        raise ValueError(
            "KvplaneConnector: 'token' in kv_connector_extra_config would be logged by vLLM's "
            "config dump; give it as KVPLANE_TOKEN in the environment, or as 'token_file' (a "
            "path) in kv_connector_extra_config"
        )
    token = os.environ.get("KVPLANE_TOKEN")
    if token:
        return token
    path = extra.get("token_file")
    if not path:
        return None
    try:
        with open(str(path)) as handle:
            return handle.read().strip() or None
    except OSError as error:
        raise ValueError(f"KvplaneConnector: token_file {path!r}: {error.strerror}") from None


# -------------------------------------------------------------------------------------------
# what the prefill's answer carries, and what the decode accepts of it
# -------------------------------------------------------------------------------------------


def block_digests(tokens: list[int], block_size: int, limit: int | None = None) -> list[str]:
    """Chained digests of a prompt's blocks: block ``i`` covers tokens ``[i × block_size,
    min((i + 1) × block_size, limit))`` and its digest hashes the previous one with them, as
    vLLM's block hashes do. ``limit`` (the prefill's token count) ends the last block there;
    blocks past the tokens given are left out."""
    end_all = len(tokens) if limit is None else limit
    digests: list[str] = []
    previous = b""
    for start in range(0, end_all, block_size):
        end = min(start + block_size, end_all)
        if end > len(tokens):
            break
        digest = hashlib.sha256(previous + array("q", tokens[start:end]).tobytes()).digest()
        previous = digest[: DIGEST_CHARS // 2]
        digests.append(previous.hex())
    return digests


class ParamsError(ValueError):
    """``kv_transfer_params`` this connector cannot load from (missing, foreign or malformed)."""


Blocks = tuple[int | None, ...]  # one KV cache group's blocks of a prompt; None: dropped


@dataclass(frozen=True)
class RemotePrefill:
    """A prefill engine's answer, checked: what a decode request may load."""

    context: str  # the prefill's kvplane instance
    request_id: str  # the prefill engine's id of the request
    groups: tuple[Blocks, ...]  # per KV cache group, the prefill's blocks of the prompt, in order
    num_tokens: int  # the prompt's tokens the prefill computed
    block_size: int
    digests: tuple[str, ...]  # block_digests() of the prefill's prompt

    @property
    def block_ids(self) -> Blocks:
        """The first (with one KV cache group, the only) group's blocks."""
        return self.groups[0]

    def matched_tokens(self, prompt: list[int]) -> int:
        """The leading tokens of ``prompt`` whose KV this prefill holds: whole matching blocks,
        and the last (partial) block only when ``prompt`` has every prefilled token."""
        mine = block_digests(prompt, self.block_size, limit=self.num_tokens)
        count = 0
        for ours, theirs in zip(mine, self.digests, strict=False):
            if ours != theirs:
                break
            count += 1
        return min(count * self.block_size, self.num_tokens)


def _int(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ParamsError(f"{name} {str(value)[:40]!r}: an integer in [{low}, {high}]")
    return value


def _identifier(value: Any, name: str) -> str:
    if not isinstance(value, str) or not REQUEST_ID.match(value):
        raise ParamsError(
            f"{name} {str(value)[:40]!r}: 1-200 characters of letters, digits, ._:@/+=-"
        )
    return value


def parse_params(params: Mapping[str, Any]) -> RemotePrefill:
    """A prefill's ``kv_transfer_params`` as this connector wrote them, or :class:`ParamsError`
    saying what is missing or wrong (another connector's params, a client's own, or forged)."""
    if "kvplane_context" not in params:
        raise ParamsError("not a kvplane prefill's params (no kvplane_context)")
    context = _identifier(params.get("kvplane_context"), "kvplane_context")
    request_id = _identifier(params.get("remote_request_id"), "remote_request_id")
    num_tokens = _int(params.get("remote_num_tokens"), "remote_num_tokens", 1, 1 << 31)
    block_size = _int(params.get("kvplane_block_size"), "kvplane_block_size", 1, 1 << 16)
    needed = -(-num_tokens // block_size)
    digests = params.get("kvplane_digests")
    if (
        not isinstance(digests, list)
        or len(digests) != needed
        or not all(isinstance(d, str) and _HEX.match(d) for d in digests)
    ):
        raise ParamsError(
            f"kvplane_digests: {needed} block digests of {DIGEST_CHARS} hex characters"
        )
    groups = _block_groups(params.get("remote_block_ids"), num_tokens, needed)
    return RemotePrefill(context, request_id, groups, num_tokens, block_size, tuple(digests))


def _block_groups(ids: Any, num_tokens: int, needed: int) -> tuple[Blocks, ...]:
    """``remote_block_ids``: a list of block ids (one KV cache group), or a list of such
    lists, one per group, where null marks a block the group no longer holds (a sliding
    window's). Cut to the ``needed`` blocks of the prompt."""
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_BLOCKS:
        raise ParamsError("remote_block_ids: a non-empty list of block ids")
    grouped = isinstance(ids[0], list)
    lists = ids if grouped else [ids]
    if grouped and len(lists) > MAX_GROUPS:
        raise ParamsError(f"remote_block_ids: at most {MAX_GROUPS} KV cache groups")
    groups: list[Blocks] = []
    seen: set[int] = set()
    for index, blocks in enumerate(lists):
        name = f"remote_block_ids[{index}]" if grouped else "remote_block_ids"
        if not isinstance(blocks, list) or not 0 < len(blocks) <= MAX_BLOCKS:
            raise ParamsError(f"{name}: a non-empty list of block ids")
        if len(blocks) < needed:
            raise ParamsError(f"{name}: {len(blocks)} blocks for {num_tokens} tokens")
        group = tuple(
            None if b is None and grouped else _int(b, f"{name} item", 0, (1 << 31) - 1)
            for b in blocks[:needed]
        )
        present = [b for b in group if b is not None]
        if not present or len(set(present)) != len(present) or seen.intersection(present):
            raise ParamsError(f"{name}: a block id appears twice, or none is given")
        seen.update(present)
        groups.append(group)
    return tuple(groups)


def window_gap(remote: RemotePrefill, matched: int, windows: Sequence[int | None]) -> str | None:
    """Why the first ``matched`` tokens cannot load from ``remote`` (None: they can): a block
    that the decode's attention still reads and that the prefill no longer holds. ``windows``:
    each KV cache group's sliding window in tokens, None for full attention. A sliding window
    reads a token's last ``window`` positions; the prefill dropped the blocks before its own
    last token's window, so a decode that loads fewer tokens may need one of them."""
    size = remote.block_size
    end = -(-matched // size)
    for group, (blocks, window) in enumerate(zip(remote.groups, windows, strict=True)):
        start = 0 if window is None else max(0, matched - window + 1) // size
        if any(block is None for block in blocks[start:end]):
            return (
                f"{remote.context} no longer holds the blocks of KV cache group {group} that "
                f"the first {matched} tokens need (a sliding window dropped them)"
            )
    return None


def transfer_id(request_id: str) -> str:
    """The handover id of a decode request: its own id when a handover accepts it, else a
    digest of it (a client may choose the id, e.g. with ``X-Request-Id``)."""
    if REQUEST_ID.match(request_id):
        return request_id
    return "vllm-" + hashlib.sha256(request_id.encode()).hexdigest()[:32]


class Pairings:
    """A decode scheduler's pairings with prefill instances, made off the scheduler's thread.

    ``state(context)`` answers at once: ``ready`` (compatible, as last seen), ``pending`` (a
    pairing is being made, or the control plane did not answer: asked again after
    ``PAIRING_RETRY_S``) or ``refused`` (incompatible: asked again after ``REFUSED_RETRY_S``).
    A known pairing stays ``ready`` while the control plane is down."""

    def __init__(self, make_client: Callable[[], Any], instance: str) -> None:
        self._make_client = make_client
        self.instance = instance
        self._lock = threading.Lock()
        self._ready: set[str] = set()
        self._refused: dict[str, tuple[str, float]] = {}  # context: reason, when
        self._tried: dict[str, float] = {}  # context: last attempt that failed
        self._running: set[str] = set()
        self._client: Any = None

    def state(self, context: str) -> tuple[str, str | None]:
        now = time.monotonic()
        with self._lock:
            if context in self._ready:
                return "ready", None
            refused = self._refused.get(context)
            if refused is not None and now - refused[1] < REFUSED_RETRY_S:
                return "refused", refused[0]
            if context not in self._running and now - self._tried.get(context, -1e9) >= (
                PAIRING_RETRY_S
            ):
                self._running.add(context)
                threading.Thread(
                    target=self._pair, args=(context,), daemon=True, name="kvplane-pairing"
                ).start()
            return "pending", refused[0] if refused else None

    def mark_ready(self, context: str) -> None:
        with self._lock:
            self._ready.add(context)

    def _pair(self, context: str) -> None:
        try:
            if self._client is None:
                self._client = self._make_client()
            report = self._client.create_pairing(context, self.instance)
            errors = report.get("errors") or []
            with self._lock:
                if report.get("compatible"):
                    self._ready.add(context)
                    self._refused.pop(context, None)
                elif any(e.get("code") == "instance_not_ready" for e in errors):
                    self._tried[context] = time.monotonic()  # its ranks are still registering
                else:
                    reason = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
                    log.warning(
                        "kvplane: %s -> %s is incompatible: %s", context, self.instance, reason
                    )
                    self._refused[context] = (reason or "incompatible", time.monotonic())
        except Exception as error:  # control plane down, unknown instance, ...: try again
            log.info("kvplane: pairing %s -> %s failed: %s", context, self.instance, error)
            with self._lock:
                self._tried[context] = time.monotonic()
        finally:
            with self._lock:
                self._running.discard(context)


def refusal(
    instance: str, source: str, held: tuple[list[list[int | None]], float], blocks: Any
) -> str | None:
    """Why an ask for held request ``source`` is refused (None: serve it): its hold ran out,
    or the blocks it names in some KV cache group are not a run of the ones held in that
    group, in order (forged ids)."""
    groups, until = held
    if until < time.time():
        return f"{instance} no longer holds request {source}"
    try:
        wanted = context_ids(blocks)
    except (AttributeError, KeyError, StopIteration, TypeError, ValueError, IndexError):
        return f"{instance}: a malformed block map for request {source}"
    if not wanted or not any(wanted.values()):
        return f"{instance}: no blocks asked for request {source}"
    for group, asked in wanted.items():
        ids = [b for b in groups[group] if b is not None] if 0 <= group < len(groups) else []
        if not asked:
            continue
        try:
            first = ids.index(asked[0])
        except ValueError:
            first = -1
        if first < 0 or ids[first : first + len(asked)] != asked:
            return f"{instance} holds other blocks for request {source}"
    return None


def context_ids(blocks: Any) -> dict[int, list[int]]:
    """The context side's block ids of a block map, by KV cache (layer) group."""
    wanted: dict[int, list[int]] = {}
    for key, lists in blocks.items():
        ids = lists["context"] if isinstance(lists, dict) else lists[0]
        wanted[int(key)] = [int(b) for b in ids]
    return wanted


class Quarantine(Generic[T]):
    """Items held until a wall-clock time: a failed load's blocks go back to the engine only
    once no WRITE granted before the failure can land in them (the handle's ``reusable_at``)."""

    def __init__(self) -> None:
        self._items: list[tuple[float, T]] = []

    def add(self, item: T, until: float) -> None:
        self._items.append((until, item))

    def due(self, now: float) -> list[T]:
        """The items whose time has come (removed); the rest stay."""
        ready = [item for until, item in self._items if until <= now]
        if ready:
            self._items = [(until, item) for until, item in self._items if until > now]
        return ready

    def __len__(self) -> int:
        return len(self._items)
