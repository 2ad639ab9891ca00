"""One load process: ``python load_client.py URL INDEX OUT.json``.

Sends 120 mixed requests with plain httpx (so every status is seen, retries are counted):
registrations of its own instances, pairings of them, planned transfers (execute=false),
executed transfers of the shared ``ctx`` → ``gen`` fleet (pushed to the test's fake workers,
which record them), a ``GET ?wait=`` long-poll on each executed one, and reads. A 503 must carry
Retry-After and is retried after it; a 409 ``conflict`` (two writers raced on a unique key) is
retried too. Writes what it saw.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from geometry.builders import ViewSpec, instance_body  # noqa: E402

VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]
INSTANCES = 20  # each: register, pair, one planned and one executed transfer
EXTRA_TRANSFERS = 10
READS = 9
REQUESTS = 1 + INSTANCES * 4 + EXTRA_TRANSFERS + INSTANCES + READS
WAIT_S = 30


def main(url: str, index: int, out: Path) -> None:
    statuses: Counter[int] = Counter()
    bad: list[str] = []
    executed: list[str] = []
    settled: Counter[str] = Counter()
    latencies: list[float] = []
    waits: list[float] = []
    retries = Counter[str]()

    def call(method: str, path: str, **kwargs: Any) -> httpx.Response:
        for _ in range(50):
            started = time.perf_counter()
            response = http.request(method, path, **kwargs)
            latencies.append(time.perf_counter() - started)
            statuses[response.status_code] += 1
            if response.status_code == 503 and "retry-after" in response.headers:
                retries["503"] += 1
                time.sleep(min(1.0, float(response.headers["retry-after"])) / 4)
                continue
            if response.status_code == 409 and response.json().get("code") == "conflict":
                retries["409"] += 1
                continue
            if response.status_code >= 500:
                bad.append(f"{method} {path}: {response.status_code} {response.text[:300]}")
            return response
        raise AssertionError(f"{method} {path}: still busy after 50 tries")

    def expect(response: httpx.Response, *codes: int) -> Any:
        if response.status_code not in codes:
            bad.append(
                f"{response.request.method} {response.request.url.path}: "
                f"{response.status_code} {response.text[:300]}"
            )
            return None
        return response.json() if response.content else None

    gen = instance_body(role="generation", views=VIEWS, tp=1, tokens_per_block=4, num_slots=64)
    ctx = instance_body(role="context", views=VIEWS, tp=1, tokens_per_block=4, num_slots=64)
    gen_name = f"load-gen-{index}"
    blocks = {"0": {"context": [0, 1, 2], "generation": [3, 4, 5]}}

    def planned(k: int, j: int) -> None:
        body = {
            "context": f"load-ctx-{index}-{k}",
            "generation": gen_name,
            "request_id": f"load-{index}-{k}-{j}",
            "blocks": blocks,
            "execute": False,
        }
        expect(call("POST", "/v1/transfers", json=body), 201)

    def execute(k: int) -> None:
        body = {
            "context": "ctx",
            "generation": "gen",
            "request_id": f"exec-{index}-{k}",
            "blocks": {"0": {"context": [k, k + 1], "generation": [k + 2, k + 3]}},
            "execute": True,
        }
        read = expect(call("POST", "/v1/transfers", json=body), 201)
        if read:
            executed.append(read["id"])

    with httpx.Client(base_url=url, timeout=WAIT_S + 60.0) as http:
        requests = 0
        expect(call("PUT", f"/v1/instances/{gen_name}", json=gen), 201)
        requests += 1
        for k in range(INSTANCES):
            expect(call("PUT", f"/v1/instances/load-ctx-{index}-{k}", json=ctx), 201)
            pairing = expect(
                call(
                    "POST",
                    "/v1/pairings",
                    json={"context": f"load-ctx-{index}-{k}", "generation": gen_name},
                ),
                201,
            )
            assert pairing is None or pairing["compatible"], pairing
            planned(k, 0)
            execute(k)
            requests += 4
        for j in range(EXTRA_TRANSFERS):
            planned(j, 1)
            requests += 1
        for transfer_id in executed:
            started = time.perf_counter()
            read = expect(call("GET", f"/v1/transfers/{transfer_id}", params={"wait": WAIT_S}), 200)
            waits.append(time.perf_counter() - started)
            settled[read["status"] if read else "?"] += 1
            requests += 1
        for j in range(READS):
            path = ("/v1/instances", "/v1/pairings", "/v1/transfers")[j % 3]
            expect(call("GET", path), 200)
            requests += 1
    out.write_text(
        json.dumps(
            {
                "requests": requests,
                "statuses": {str(k): v for k, v in statuses.items()},
                "bad": bad,
                "executed": executed,
                "settled": dict(settled),
                "retries": dict(retries),
                "latencies": latencies,
                "waits": waits,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
