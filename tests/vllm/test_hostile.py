"""The engine boundary under what a client or a router can send: two vLLM OpenAI servers with
``KvplaneConnector`` (prefix caching on, the decode with ``kv_load_failure_policy: recompute``)
and ``examples/vllm_proxy.py`` in front of them.

Every case sends a request that used to kill the decode engine, hang, decode from another
prompt's KV, or strand blocks. Each must answer with the tokens the decode server computes by
itself for the same prompt, and afterwards (``_unharmed``) both servers answer ``/health``, a
normal completion through the proxy still decodes exactly as one engine does, and both
engines' ``vllm:kv_cache_usage_perc`` is back to 0 within ``SETTLE_S`` (a plain engine's
behaviour): no block is left held.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.engine import ControlPlane
from workers.testing.vllm_bed import (
    Process,
    Side,
    complete,
    completion,
    kvplane_holds,
    prompts,
    serve_pair,
    write_model,
)

from .conftest import require_vllm

pytestmark = pytest.mark.slow

HOLD_S = 10.0  # the prefill's hold: well above SETTLE_S, so a release shows against it
TIMEOUT_S = 5.0  # the decode's receive and first-contact timeout
SETTLE_S = 2.0  # KV usage back to 0 this long after the decode's end
_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\}\s+(\S+)$", re.M)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-hostile")
    model = write_model(workdir)
    plane = ControlPlane(workdir)
    plane.start()
    try:
        # Two sequences at a time: a third request waits unscheduled (the abort case). A stop
        # gives the ranks 10 s to stop their workers (vLLM's default kills them).
        with serve_pair(
            workdir,
            model,
            plane.url,
            prefill=Side("0", extra={"hold_s": HOLD_S}),
            decode=Side("1", extra={"timeout_s": TIMEOUT_S, "kv_load_failure_policy": "recompute"}),
            prefix_caching=True,
            # float32: these cases compare a handover's tokens with one engine's, and in
            # bfloat16 a decode that computes only the last prompt token over loaded KV rounds
            # differently from one engine computing the whole prompt; a near-tie in the tiny
            # random model's logits then flips greedy decoding. Seen here once, with a
            # verified, byte-exact transfer: a 70-token prompt (seed 113) whose continuation
            # equals one engine's in float32 and differs from it in bfloat16.
            args=("--max-num-seqs", "2", "--shutdown-timeout", "10", "--dtype", "float32"),
        ) as pair:
            yield {**pair, "plane": plane, "decode_server": pair["processes"][1]}
    finally:
        plane.stop()


def _body(servers: dict[str, Any], prompt: list[int], **more: Any) -> dict[str, Any]:
    return completion(servers["model"], prompt, **more)


def _post(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def _complete(url: str, body: dict[str, Any]) -> list[int]:
    return complete(url, body, timeout_s=60.0)


def _alone(servers: dict[str, Any], prompt: list[int]) -> list[int]:
    """What one engine answers: the decode server by itself (no kv_transfer_params), under a
    cache salt of its own, so that neither this run nor a handover reuses the other's blocks."""
    return _complete(servers["decode"], _body(servers, prompt, cache_salt="one-engine"))


def _prefill(servers: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """The proxy's first leg: the prefill server's kv_transfer_params for ``prompt``."""
    body = _body(servers, prompt, max_tokens=1)
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    answer = _post(servers["prefill"], body)
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params and params["kvplane_context"] == "vllm-prefill", params
    return dict(params)


def _decode(servers: dict[str, Any], prompt: list[int], params: Any) -> list[int]:
    return _complete(servers["decode"], _body(servers, prompt, kv_transfer_params=params))


def _usage(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [float(v) for v in _USAGE.findall(text)]
    assert values, "no vllm:kv_cache_usage_perc in /metrics"
    return max(values)


def _freed(url: str, before: dict[str, float], outcome: str, within_s: float) -> dict[str, float]:
    """The prefill's hold outcomes once ``outcome`` counted one more than ``before`` (vLLM
    carries them with a step's stats), or as they are after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        now = kvplane_holds(url)
        if now.get(outcome, 0) > before.get(outcome, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _settled(url: str, within_s: float) -> float:
    """The engine's KV usage once it is 0, or the last value after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        usage = _usage(url)
        if usage == 0.0 or time.monotonic() > deadline:
            return usage
        time.sleep(0.1)


def _unharmed(servers: dict[str, Any], within_s: float = SETTLE_S) -> None:
    """Both engines up, a normal request decodes as one engine does, no block left held."""
    assert _settled(servers["prefill"], within_s) == 0.0
    assert _settled(servers["decode"], within_s) == 0.0
    for name in ("prefill", "decode"):
        assert httpx.get(f"{servers[name]}/health", timeout=10).status_code == 200
    prompt = prompts(int(time.time() * 1000) % 100_000, (77,))[0]  # unseen: a real handover
    assert _complete(servers["proxy"], _body(servers, prompt)) == _alone(servers, prompt)
    assert _settled(servers["prefill"], SETTLE_S) == 0.0
    assert _settled(servers["decode"], SETTLE_S) == 0.0


def _done_transfers(servers: dict[str, Any]) -> list[dict[str, Any]]:
    url = servers["plane"].url
    items = httpx.get(f"{url}/v1/transfers", params={"limit": 200}, timeout=10).json()["items"]
    return [t for t in items if t["status"] == "done"]


def test_foreign_and_malformed_params_compute_locally(servers: dict[str, Any]) -> None:
    """NixlConnector-style params (no kvplane keys), a client's own, and kvplane params with
    wrong types: the decode computes the prompt itself; it used to die (KeyError in the
    scheduler, then EngineDeadError and a 500 for every later request)."""
    prompt = prompts(101, (100,))[0]
    alone = _alone(servers, prompt)
    nixl_style = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3, 4],
        "remote_engine_id": "some-engine",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }
    real = _prefill(servers, prompt)
    malformed = [
        nixl_style,
        {"do_remote_prefill": True},
        {"do_remote_prefill": True, "kvplane_context": 7},
        {**real, "remote_block_ids": ["a", "b", "c", "d"]},
        {**real, "remote_block_ids": []},
        {**real, "kvplane_digests": ["zz"] * 4},
        {**real, "remote_num_tokens": -1},
        {**real, "remote_request_id": "x" * 500},
    ]
    for params in malformed:
        assert _decode(servers, prompt, params) == alone, params
    _unharmed(servers, within_s=HOLD_S + SETTLE_S)  # nobody loaded `real`: its hold runs out


def test_the_same_params_twice_at_once(servers: dict[str, Any]) -> None:
    """A router's retry: the same params sent twice at once. Both answer, with one engine's
    tokens (one loads, the other computes); one used to hang and the other to break."""
    prompt = prompts(102, (130,))[0]
    alone = _alone(servers, prompt)
    params = _prefill(servers, prompt)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(
                lambda _: _post(
                    servers["decode"], _body(servers, prompt, kv_transfer_params=dict(params))
                ),
                range(2),
            )
        )
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == alone
    _unharmed(servers)


@pytest.mark.parametrize(
    "change",
    ["longer", "shorter", "first token"],
)
def test_another_prompt_never_decodes_from_the_prefilled_kv(
    servers: dict[str, Any], change: str
) -> None:
    """The decode gets a prompt other than the prefilled one: it loads only the leading blocks
    whose tokens are equal and computes the rest, exactly as one engine does."""
    prefilled = prompts(103, (100,))[0]
    decoded = {
        "longer": prefilled + prompts(104, (37,))[0],
        "shorter": prefilled[:50],
        "first token": [(prefilled[0] + 1) % 4000 + 5, *prefilled[1:]],
    }[change]
    alone = _alone(servers, decoded)
    params = _prefill(servers, prefilled)
    assert _decode(servers, decoded, params) == alone
    _unharmed(servers)


def test_forged_and_unknown_requests_are_refused_by_the_prefill(servers: dict[str, Any]) -> None:
    """Block ids the prefill does not hold for that request, a request id it never held, and a
    prefill instance nobody registered: each decode recomputes its prompt (the policy is
    ``recompute``) and the engine stays up; these used to answer 500."""
    prompt = prompts(105, (120,))[0]
    alone = _alone(servers, prompt)
    forgeries = [
        lambda p: {**p, "remote_block_ids": [b + 1 for b in p["remote_block_ids"]]},
        lambda p: {**p, "remote_block_ids": list(reversed(p["remote_block_ids"]))},
        lambda p: {**p, "remote_request_id": "cmpl-never-held-0"},
        lambda p: {**p, "kvplane_context": "vllm-nobody"},
    ]
    for index, forge in enumerate(forgeries):
        salted = [prompt[0] + index + 1, *prompt[1:]]  # a fresh prefill request each time
        params = forge(_prefill(servers, salted))
        started = time.monotonic()
        assert _decode(servers, salted, params) == _alone(servers, salted), params
        # Refused at once, or (the unknown instance) given up after the first-contact timeout.
        assert time.monotonic() - started < TIMEOUT_S + 10
        # The prefill's blocks: freed by the refusal, or (an id the prefill never saw) at hold_s.
        _unharmed(servers, within_s=SETTLE_S if index < 2 else HOLD_S + SETTLE_S)
    # Real params still load.
    assert _decode(servers, prompt, _prefill(servers, prompt)) == alone
    _unharmed(servers)


def test_a_local_prefix_hit_releases_the_prefill_at_once(servers: dict[str, Any]) -> None:
    """The decode's own prefix cache already holds every prefilled token: it loads nothing and
    tells the prefill to free the blocks now, not after ``hold_s``."""
    head = prompts(106, (64,))[0]
    longer = head + prompts(107, (40,))[0]
    alone = _alone(servers, longer)
    # The decode computes `longer` once without a salt: its cache then holds `head`'s blocks.
    assert _complete(servers["decode"], _body(servers, longer)) == alone
    params = _prefill(servers, head)
    assert _usage(servers["prefill"]) > 0.0  # the prefill holds the request's blocks
    before = kvplane_holds(servers["prefill"])
    assert _decode(servers, longer, params) == alone
    _unharmed(servers)
    after = _freed(servers["prefill"], before, "released", SETTLE_S)
    assert after.get("released", 0) >= before.get("released", 0) + 1, (before, after)
    assert after.get("expired", 0) == before.get("expired", 0), (before, after)


def test_a_decode_aborted_before_it_loads_releases_the_prefill(servers: dict[str, Any]) -> None:
    """A client gives up on its decode request while it waits to be scheduled (the engine's two
    sequences are busy with long streams, two more wait ahead of it): the prefill frees the
    request's blocks at once, while the streams still run, not after ``hold_s``."""
    prompt = prompts(108, (90,))[0]
    # As long as the model allows (2,048 positions). Two streams fill the engine's two
    # sequences and two more wait ahead of the victim: a fast machine decodes one in ~5 s.
    long_body = _body(servers, prompts(109, (40,))[0], max_tokens=2000, stream=True)
    started = threading.Barrier(3)
    stop = threading.Event()

    def stream(first: bool) -> int:
        lines = 0
        with httpx.stream(
            "POST", f"{servers['decode']}/v1/completions", json=long_body, timeout=120
        ) as answer:
            assert answer.status_code == 200
            for _ in answer.iter_lines():
                lines += 1
                if lines == 3 and first:
                    started.wait(30)  # both sequences decode: later requests wait
                if stop.is_set():
                    break
        return lines

    # First the prefill, while the engines are idle (a cold prefill under the streams' load
    # took up to 17 s here); its hold is still running when the victim is aborted.
    params = _prefill(servers, prompt)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(stream, True) for _ in range(2)]
        queued: list[concurrent.futures.Future[int]] = []
        try:
            started.wait(30)
            queued = [pool.submit(stream, False) for _ in range(2)]
            time.sleep(0.5)  # both in the engine's queue before the victim
            assert _usage(servers["prefill"]) > 0.0  # still held for the decode
            before = kvplane_holds(servers["prefill"])
            # The client closes its connection after 1 s, unanswered: vLLM aborts the request.
            with pytest.raises(httpx.TimeoutException):
                _post(servers["decode"], _body(servers, prompt, kv_transfer_params=params), 1.0)
            # The victim never got a slot: it waits behind both queued streams (first come,
            # first served), and neither has ended.
            assert not any(future.done() for future in queued)
            assert _settled(servers["prefill"], SETTLE_S) == 0.0
            # Freed by the decode's release, not by the hold running out (which a slow or
            # paused host could make look quick): the prefill counts each.
            after = _freed(servers["prefill"], before, "released", SETTLE_S)
            assert after.get("released", 0) >= before.get("released", 0) + 1, (before, after)
            assert after.get("expired", 0) == before.get("expired", 0), (before, after)
        finally:
            stop.set()
            for future in busy + queued:
                assert future.result() > 0
    _unharmed(servers)


def test_a_decode_that_never_comes_frees_the_blocks_after_the_hold(
    servers: dict[str, Any],
) -> None:
    """The proxy dies between its two legs: the prefill holds the blocks for ``hold_s``, then
    frees them."""
    before = kvplane_holds(servers["prefill"])
    params = _prefill(servers, prompts(110, (150,))[0])
    assert params["remote_block_ids"]
    time.sleep(SETTLE_S + 1)
    assert _usage(servers["prefill"]) > 0.0
    _unharmed(servers, within_s=HOLD_S + SETTLE_S)
    after = _freed(servers["prefill"], before, "expired", SETTLE_S)
    assert after.get("expired", 0) == before.get("expired", 0) + 1, (before, after)


def test_fault_hooks_need_the_test_switch(servers: dict[str, Any]) -> None:
    """A client's ``kvplane_fault_*`` params do nothing in an engine started without
    ``KVPLANE_TEST_FAULTS=1``: every block loads, and the KV is the prompt's own."""
    prompt = prompts(111, (160,))[0]
    alone = _alone(servers, prompt)
    params = {**_prefill(servers, prompt), "kvplane_fault_skip_blocks": 3}
    assert _decode(servers, prompt, params) == alone
    other = prompts(112, (160,))[0]
    params = {**_prefill(servers, other), "kvplane_fault_trust_tokens": True}
    assert _decode(servers, prompt, params) == alone
    _unharmed(servers)


def test_rest_pushed_transfers_cannot_write_live_kv(servers: dict[str, Any]) -> None:
    """``POST /v1/transfers`` with ``execute=true`` naming the two engines: their workers refuse
    it, the control plane records the transfer failed with the reason, and the engines' KV is
    untouched (a completion still decodes as one engine does)."""
    url = servers["plane"].url
    body = {
        "context": "vllm-prefill",
        "generation": "vllm-decode",
        "request_id": "outsider-1",
        "blocks": {"0": {"context": [1, 2, 3], "generation": [4, 5, 6]}},
        "execute": True,
    }
    created = httpx.post(f"{url}/v1/transfers", json=body, timeout=30)
    assert created.status_code == 201, created.text
    transfer = created.json()
    deadline = time.monotonic() + 30
    while transfer["status"] not in ("failed", "done") and time.monotonic() < deadline:
        time.sleep(0.3)
        transfer = httpx.get(f"{url}/v1/transfers/{transfer['id']}", timeout=10).json()
    assert transfer["status"] == "failed", transfer
    assert "take no REST-pushed transfers" in str(transfer.get("error")), transfer
    _unharmed(servers)


def test_first_contact_and_a_control_plane_outage_never_block_a_step(
    servers: dict[str, Any],
) -> None:
    """With the control plane down, the known prefill keeps handing over KV; a request that
    names a prefill this decode cannot pair with waits off the step loop, then computes locally
    after ``timeout_s``, while other requests decode meanwhile."""
    plane: ControlPlane = servers["plane"]
    warm = prompts(113, (70,))[0]
    assert _complete(servers["proxy"], _body(servers, warm)) == _alone(servers, warm)
    plane.stop()
    try:
        prompt = prompts(114, (96,))[0]
        alone = _alone(servers, prompt)
        assert _complete(servers["proxy"], _body(servers, prompt)) == alone
        ghost = {**_prefill(servers, prompt), "kvplane_context": "vllm-elsewhere"}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            waiting = pool.submit(_decode, servers, prompt, ghost)
            time.sleep(0.5)
            other = prompts(115, (50,))[0]
            assert _complete(servers["proxy"], _body(servers, other)) == _alone(servers, other)
            assert not waiting.done()  # still waiting for its pairing, the engine not
            assert waiting.result() == alone
            assert time.monotonic() - started >= TIMEOUT_S
    finally:
        plane.start()
    _unharmed(servers, within_s=HOLD_S + SETTLE_S)  # `ghost`'s real prefill: hold runs out
    assert _done_transfers(servers)


def test_zz_a_clean_engine_stop_reads_stopped(servers: dict[str, Any]) -> None:
    """Last in this module: the decode server stopped as an operator stops it (SIGTERM, with
    ``--shutdown-timeout``): its workers report ``stopped`` at once, not ``alive`` until the
    control plane's liveness window runs out."""
    url = servers["plane"].url
    server: Process = servers["decode_server"]
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout=60)
    listed = httpx.get(f"{url}/v1/workers", params={"instance": "vllm-decode"}, timeout=10)
    statuses = {w["status"] for w in listed.json()["items"]}
    assert statuses == {"stopped"}, listed.json()
