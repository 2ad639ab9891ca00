"""One load process: ``python load_client.py URL INDEX WORKER_IDS_JSON OUT.json``.

Sends 100 mixed requests with plain httpx (so every status is seen, retries are counted):
registrations of its own instances, pairings of them, planned transfers (execute=false), worker
claims (completing what it claims) and reads. A 503 must carry Retry-After and is retried after
it; a 409 ``conflict`` (two writers raced on a unique key) is retried too. Writes what it saw.
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

from api.geometry.builders import ViewSpec, instance_body  # noqa: E402

VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]
INSTANCES = 20
EXTRA_TRANSFERS = 10
READS = 9


def main(url: str, index: int, worker_ids: list[str], out: Path) -> None:
    statuses: Counter[int] = Counter()
    bad: list[str] = []
    claimed: list[str] = []
    latencies: list[float] = []
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

    def transfer(k: int, j: int) -> None:
        body = {
            "context": f"load-ctx-{index}-{k}",
            "generation": gen_name,
            "request_id": f"load-{index}-{k}-{j}",
            "blocks": blocks,
            "execute": False,
        }
        expect(call("POST", "/v1/transfers", json=body), 201)

    def claim(k: int) -> None:
        worker_id = worker_ids[(index + k) % len(worker_ids)]
        lease = expect(call("POST", "/v1/jobs/claim", json={"worker_id": worker_id}), 200, 204)
        if lease:
            claimed.append(lease["id"])
            expect(
                call(
                    "POST",
                    f"/v1/jobs/{lease['id']}/complete",
                    json={"lease_token": lease["lease_token"], "bytes": 1, "duration_s": 0.0},
                ),
                200,
            )

    with httpx.Client(base_url=url, timeout=60.0) as http:
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
            transfer(k, 0)
            claim(k)
            requests += 4
        for j in range(EXTRA_TRANSFERS):
            transfer(j, 1)
            requests += 1
        for j in range(READS):
            path = ("/v1/instances", "/v1/pairings", "/v1/jobs")[j % 3]
            expect(call("GET", path), 200)
            requests += 1
    out.write_text(
        json.dumps(
            {
                "requests": requests,
                "statuses": {str(k): v for k, v in statuses.items()},
                "bad": bad,
                "claimed": claimed,
                "retries": dict(retries),
                "latencies": latencies,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4]))
