"""What crosses an engine's boundary into kvplane's connectors (``workers/connectors/boundary.py``),
without an engine: a prefill's params as a client may send them, the prompt digests that keep a
decode from another prompt's KV, the prefill's check of an ask's blocks, the token's sources,
and the release notice between two handovers."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from workers.connectors.boundary import (
    ParamsError,
    block_digests,
    control_plane_token,
    parse_params,
    refusal,
    transfer_id,
    window_gap,
)

BLOCK = 32


def _params(prompt: list[int], **more: Any) -> dict[str, Any]:
    """What the vLLM connector's prefill answers for ``prompt`` (blocks 10, 11, ...)."""
    blocks = -(-len(prompt) // BLOCK)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(10, 10 + blocks)),
        "remote_request_id": "cmpl-abc-0",
        "remote_engine_id": "vllm-prefill",
        "remote_num_tokens": len(prompt),
        "kvplane_context": "vllm-prefill",
        "kvplane_block_size": BLOCK,
        "kvplane_digests": block_digests(prompt, BLOCK),
        **more,
    }


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(length)]


def test_digests_chain_every_block_on_the_ones_before() -> None:
    prompt = _prompt(1, 100)
    digests = block_digests(prompt, BLOCK)
    assert len(digests) == 4 and len(set(digests)) == 4
    assert all(len(d) == 16 for d in digests)
    # A token changed in block 0 changes every digest after it (a chain, like vLLM's hashes);
    # one changed in block 2 leaves blocks 0 and 1 alone.
    first = block_digests([prompt[0] + 1, *prompt[1:]], BLOCK)
    assert all(a != b for a, b in zip(digests, first, strict=True))
    third = block_digests(prompt[:70] + [prompt[70] + 1] + prompt[71:], BLOCK)
    assert third[:2] == digests[:2] and third[2:] != digests[2:]
    # The same tokens in a block with another history differ.
    assert block_digests(prompt[32:64], BLOCK)[0] != digests[1]


@pytest.mark.parametrize(
    ("decoded", "matched"),
    [
        (lambda p: p, 100),  # the prefilled prompt: every token, the partial last block too
        (lambda p: p + _prompt(2, 37), 100),  # longer: the prefilled prefix
        (lambda p: p[:50], 32),  # shorter: the whole blocks it shares
        (lambda p: p[:64], 64),
        (lambda p: [p[0] + 1, *p[1:]], 0),  # the first token differs: nothing
        (lambda p: p[:40] + [p[40] + 1] + p[41:], 32),  # block 1 differs
        (lambda p: p[:99] + [p[99] + 1], 96),  # the partial last block differs
        (lambda p: p[:99], 96),  # one token short of the partial block
    ],
)
def test_a_decode_loads_only_the_leading_blocks_its_prompt_shares(decoded, matched) -> None:
    prompt = _prompt(3, 100)
    remote = parse_params(_params(prompt))
    assert remote.matched_tokens(decoded(prompt)) == matched


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kvplane_context": None}, "kvplane_context"),
        ({"kvplane_context": 7}, "kvplane_context"),
        ({"kvplane_context": "a|b"}, "kvplane_context"),
        ({"remote_request_id": "x" * 201}, "remote_request_id"),
        ({"remote_request_id": None}, "remote_request_id"),
        ({"remote_num_tokens": -1}, "remote_num_tokens"),
        ({"remote_num_tokens": True}, "remote_num_tokens"),
        ({"remote_num_tokens": "100"}, "remote_num_tokens"),
        ({"kvplane_block_size": 0}, "kvplane_block_size"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_block_ids": "10,11"}, "remote_block_ids"),
        ({"remote_block_ids": [10, 11, "12", 13]}, "remote_block_ids"),
        ({"remote_block_ids": [10, 11, -1, 13]}, "remote_block_ids"),
        ({"remote_block_ids": [10, 11, 11, 13]}, "appears twice"),
        ({"remote_block_ids": [10, 11, 12]}, "3 blocks for 100 tokens"),
        ({"remote_block_ids": [10, 11, 12, 2**40]}, "remote_block_ids"),
        ({"kvplane_digests": ["00" * 8] * 3}, "kvplane_digests"),
        ({"kvplane_digests": ["zz" * 8] * 4}, "kvplane_digests"),
        ({"kvplane_digests": None}, "kvplane_digests"),
        ({"remote_num_tokens": 200}, "kvplane_digests"),
    ],
)
def test_malformed_params_are_refused_with_the_field(change, message) -> None:
    params = _params(_prompt(4, 100))
    for key, value in change.items():
        if value is None:
            params.pop(key)
        else:
            params[key] = value
    with pytest.raises(ParamsError, match=message):
        parse_params(params)


def test_foreign_params_are_not_kvplanes() -> None:
    """NixlConnector's answer (or a client's own) names no kvplane prefill."""
    nixl = {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2, 3],
        "remote_engine_id": "e",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }
    with pytest.raises(ParamsError, match="not a kvplane prefill"):
        parse_params(nixl)


def test_extra_block_ids_past_the_prompt_are_ignored() -> None:
    params = _params(_prompt(5, 64), remote_block_ids=[10, 11, 12])
    assert parse_params(params).block_ids == (10, 11)


def test_a_transfer_id_is_the_request_id_when_a_handover_takes_it() -> None:
    assert transfer_id("cmpl-123-0-a1b2") == "cmpl-123-0-a1b2"
    odd = transfer_id("client's id with spaces|and bars")
    assert odd.startswith("vllm-") and len(odd) == 37
    assert transfer_id("x" * 300) != transfer_id("x" * 301)


def test_the_prefill_serves_only_a_run_of_the_blocks_it_holds() -> None:
    held = ([[10, 11, 12, 13]], time.time() + 60)

    def ask(ids: list[int]) -> dict[str, Any]:
        return {"0": {"context": ids, "generation": list(range(len(ids)))}}

    assert refusal("p", "r", held, ask([10, 11, 12, 13])) is None
    assert refusal("p", "r", held, ask([11, 12])) is None  # the decode's cache held block 0
    for forged in ([11, 12, 13, 14], [13, 12], [10, 12], [99], []):
        assert refusal("p", "r", held, ask(forged)) is not None, forged
    assert "malformed" in str(refusal("p", "r", held, {"0": {"context": ["a"]}}))
    assert "no longer holds" in str(refusal("p", "r", ([[10]], time.time() - 1), ask([10])))


def test_each_kv_cache_group_is_checked_on_its_own() -> None:
    """A hybrid model (vLLM's hybrid KV cache manager): a full-attention group and a
    sliding-window group whose first blocks the window dropped (None)."""
    held = ([[10, 11, 12, 13], [None, None, 21, 22]], time.time() + 60)

    def ask(full: list[int], window: list[int]) -> dict[str, Any]:
        return {"0": {"context": full, "generation": full}, "1": {"context": window}}

    assert refusal("p", "r", held, ask([10, 11, 12, 13], [21, 22])) is None
    assert refusal("p", "r", held, ask([12, 13], [22])) is None
    assert refusal("p", "r", held, ask([10, 11, 12, 13], [20, 21])) is not None
    assert refusal("p", "r", held, ask([10, 11, 12, 13], [10])) is not None  # another group's
    assert refusal("p", "r", held, {"0": {"context": [10]}, "5": {"context": [21]}}) is not None


def test_grouped_block_ids_carry_dropped_blocks_as_null() -> None:
    prompt = _prompt(6, 100)  # 4 blocks
    params = _params(prompt, remote_block_ids=[[10, 11, 12, 13], [None, None, 21, 22]])
    remote = parse_params(params)
    assert remote.groups == ((10, 11, 12, 13), (None, None, 21, 22))
    assert remote.block_ids == (10, 11, 12, 13)
    for bad, message in (
        ([[10, 11, 12, 13], [None, None, 21]], r"remote_block_ids\[1\]: 3 blocks"),
        ([[10, 11, 12, 13], [None, None, 21, 12]], "appears twice"),  # two groups, one block
        ([[10, 11, 12, 13], [None, None, None, None]], "none is given"),
        ([[10, 11, 12, 13], "21,22"], r"remote_block_ids\[1\]"),
        ([[10, 11, 12, 13], [None, None, 21, -5]], r"remote_block_ids\[1\] item"),
        ([[10, 11, 12, 13]] * 65, "at most 64"),
    ):
        with pytest.raises(ParamsError, match=message):
            parse_params({**params, "remote_block_ids": bad})
    # Null stands for a dropped block only in the grouped form.
    with pytest.raises(ParamsError, match="remote_block_ids item"):
        parse_params({**params, "remote_block_ids": [10, None, 12, 13]})


def test_a_sliding_window_load_needs_the_blocks_its_window_reads() -> None:
    """Window 40 tokens, blocks of 32: a prefill of 100 tokens keeps the blocks of tokens 61-99
    (blocks 1-3) and dropped block 0. A decode that continues at token t reads tokens t-39 on."""
    prompt = _prompt(7, 100)
    remote = parse_params(_params(prompt, remote_block_ids=[[10, 11, 12, 13], [None, 20, 21, 22]]))
    windows = [None, 40]
    assert window_gap(remote, 100, windows) is None
    assert window_gap(remote, 71, windows) is None  # reads from token 32: block 1
    assert "KV cache group 1" in str(window_gap(remote, 70, windows))  # from token 31: block 0
    assert window_gap(remote, 64, [None, None]) is not None  # full attention reads everything


def test_the_token_never_comes_from_the_logged_config(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVPLANE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="KVPLANE_TOKEN"):
        control_plane_token({"token": "secret"})
    assert control_plane_token({}) is None
    path = tmp_path / "token"
    path.write_text("from-a-file\n")
    assert control_plane_token({"token_file": str(path)}) == "from-a-file"
    with pytest.raises(ValueError, match="token_file"):
        control_plane_token({"token_file": str(tmp_path / "missing")})
    monkeypatch.setenv("KVPLANE_TOKEN", "from-the-environment")
    assert control_plane_token({"token_file": str(path)}) == "from-the-environment"


def test_a_release_notice_reaches_the_context_engine_from_paired_workers_only() -> None:
    """``Handover.release`` on a generation rank sends ``R`` to each writer of its plan, from
    the progress thread, loading a writer it has not met first; it answers None for a pairing
    its directory does not know. The context rank hands the notice to ``on_release`` only when
    it comes from a paired worker."""
    import torch

    from workers.directory import Directory, PeerWorker, PlanEntry
    from workers.handover import Handover

    sent: list[tuple[str, bytes]] = []
    loaded: list[str] = []
    sent_one = threading.Event()

    def send_notif(agent: str, msg: bytes) -> None:
        assert agent in loaded, "a notice to a peer that is not loaded"
        sent.append((agent, msg))
        sent_one.set()

    transport = SimpleNamespace(
        staging=torch.empty(64, dtype=torch.uint8),
        pools={},
        send_notif=send_notif,
        has_peer=lambda agent: agent in loaded,
        add_peer=lambda info: loaded.append(info["agent"]),
    )
    released: list[tuple[str, str]] = []
    seen = threading.Event()

    def on_release(request_id: str, peer: str) -> None:
        released.append((request_id, peer))
        seen.set()

    route = SimpleNamespace(sender_rank=1, receiver_rank=0)  # all release() reads of a route
    entry = PlanEntry("p", "ctx", "gen", "ce", "ge", None, None, (1,), (0,), (route,), ({},))  # type: ignore[arg-type]
    writer = PeerWorker("ctx", 1, "ce", "w-ctx-1", "agent-ctx-1", {"agent": "agent-ctx-1"})
    reader = PeerWorker("gen", 0, "ge", "w-gen-0", "agent-gen-0", {})
    generation = Handover(
        transport,  # type: ignore[arg-type]
        instance="gen",
        rank=0,
        directory=Directory(
            "r",
            "gen",
            "generation",
            0,
            "ge",
            plans={("ctx", None, None): entry},
            peers={("ctx", 1): writer},
        ),
    )
    context = Handover(
        transport,  # type: ignore[arg-type]
        instance="ctx",
        rank=1,
        on_release=on_release,
        directory=Directory("r", "ctx", "context", 1, "ce", peers={("gen", 0): reader}),
    )
    try:
        assert generation.release("cmpl-1", "ctx") == 1
        assert generation.release("cmpl-1", "unpaired") is None
        assert generation.release("bad|id", "ctx") == 0
        assert sent_one.wait(5)
        assert loaded == ["agent-ctx-1"]
        assert sent == [("agent-ctx-1", b"R|cmpl-1|ce|ge|1|0")]

        context._on_notification("agent-stranger", sent[0][1])  # not a paired worker: parked
        context._on_notification("agent-gen-0", sent[0][1])
        assert seen.wait(5)
        assert released == [("cmpl-1", "gen")]
        # A worker the context rank's directory does not name yet (its pairing is newer): its
        # notice waits for the refresh that names it; the stranger's is never handed on.
        seen.clear()
        context._on_notification("agent-gen-1", b"R|cmpl-2|ce|ge|1|1")
        assert released == [("cmpl-1", "gen")]
        newcomer = PeerWorker("gen", 1, "ge", "w-gen-1", "agent-gen-1", {})
        context.set_directory(
            Directory(
                "r2",
                "ctx",
                "context",
                1,
                "ce",
                peers={("gen", 0): reader, ("gen", 1): newcomer},
            )
        )
        assert seen.wait(5)
        assert released == [("cmpl-1", "gen"), ("cmpl-2", "gen")]
    finally:
        generation.close()
        context.close()


def test_a_failed_loads_blocks_come_back_only_once_no_write_can_land() -> None:
    from workers.connectors.boundary import Quarantine

    held: Quarantine[str] = Quarantine()
    held.add("late", until=110.0)
    held.add("early", until=100.0)
    assert held.due(99.9) == [] and len(held) == 2
    assert held.due(100.0) == ["early"]
    assert held.due(105.0) == [] and len(held) == 1
    assert held.due(110.5) == ["late"] and len(held) == 0
