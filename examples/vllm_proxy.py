"""A prefill/decode proxy in front of two vLLM OpenAI servers that run ``KvplaneConnector``.

Each ``POST /v1/completions`` goes twice: to the prefill server with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``, then, with the ``kv_transfer_params`` that
answer returned (unchanged), to the decode server, whose answer (streamed or not) is the
client's. The decode server loads the prompt's KV through kvplane instead of computing it::

    python examples/vllm_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 9000

Runs in either environment (FastAPI, httpx and uvicorn are in both). One prefill and one decode
server; a router over several would pick them per request the same way.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def create_app(prefill: str, decode: str, timeout_s: float = 300.0) -> FastAPI:
    client = httpx.AsyncClient(timeout=timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="kvplane vLLM P/D proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        first = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        first.pop("stream_options", None)
        prefilled = await client.post(f"{prefill}/v1/completions", json=first)
        if prefilled.status_code != 200:
            return Response(
                prefilled.content,
                status_code=prefilled.status_code,
                media_type=prefilled.headers.get("content-type"),
            )
        params = prefilled.json().get("kv_transfer_params")
        second = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            decoded = await client.post(f"{decode}/v1/completions", json=second)
            return JSONResponse(decoded.json(), status_code=decoded.status_code)

        async def relay() -> AsyncIterator[bytes]:
            async with client.stream("POST", f"{decode}/v1/completions", json=second) as answer:
                async for chunk in answer.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL")
    parser.add_argument("--decode", required=True, help="the decode server's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    app = create_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
