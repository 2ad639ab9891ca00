"""Local transport: sender and receiver pools in one process (tests, demos, single-host engines)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.executors import Blocks, Method, Route, as_route, copy_local, gather, scatter
from workers.pools import Pool


@dataclass(frozen=True)
class LocalResult:
    nbytes: int
    seconds: float


class LocalTransport:
    """Moves routes between two sets of in-process pools, directly or through staging."""

    def __init__(self, src_pools: Mapping[int, Pool], dst_pools: Mapping[int, Pool]) -> None:
        self.src_pools = dict(src_pools)
        self.dst_pools = dict(dst_pools)

    def transfer(
        self,
        route: Route | Mapping[str, Any],
        src_blocks: Blocks,
        dst_blocks: Blocks,
        *,
        staged: bool = False,
        method: Method = "auto",
    ) -> LocalResult:
        """Execute ``route`` for these aligned block lists; ``staged`` goes through a buffer."""
        route = as_route(route)
        t0 = time.perf_counter()
        if staged:
            buf = gather(route, self.src_pools, src_blocks, method=method)
            scatter(route, buf, self.dst_pools, dst_blocks, method=method)
            nbytes = int(buf.numel())
        else:
            nbytes = copy_local(
                route, self.src_pools, self.dst_pools, src_blocks, dst_blocks, method=method
            )
        if any(p.device.type == "cuda" for p in self.dst_pools.values()):
            import torch

            torch.cuda.synchronize()
        return LocalResult(nbytes, time.perf_counter() - t0)
