"""``KvplaneConnector``'s handovers in vLLM's own metrics (``KVConnectorStats``).

Each rank notes every handle that resolves (peer instance, side, outcome, bytes, seconds); vLLM
collects the notes with each step's output, aggregates the ranks' and hands them to its stat
loggers, whose Prometheus logger records them on the OpenAI server's ``/metrics``:

- ``vllm:kvplane_handovers_total{peer, side, outcome}``: handles resolved (``send``:
  ``released`` or ``failed``; ``receive``: ``arrived`` or ``failed``);
- ``vllm:kvplane_bytes_total{peer, side}``: bytes of the handovers that completed;
- ``vllm:kvplane_handover_seconds{peer, side}``: from ``send``/``expect`` to the outcome;
- ``vllm:kvplane_holds_total{outcome}``: a prefill's finished requests whose blocks it held for
  a decode, by what freed them: ``sent`` (a decode asked and the sends ended), ``refused`` (the
  ask did not match what it holds), ``released`` (the decode said it will not ask: it finished,
  was aborted or hit its own prefix cache), ``routeless`` (no pairing has a route from this
  rank) or ``expired`` (``hold_s`` passed: the decode never came).

Every series also carries vLLM's own labels (``model_name``, ``engine``). The same handles are
in the control plane's record and, for a worker that serves them, in ``kvplane_worker_*``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

    from workers.handover import Handle

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0)


@dataclass
class KvplaneConnectorStats(KVConnectorStats):
    """``data["handovers"]``: one ``[peer, side, outcome, bytes, seconds]`` row per handle;
    ``data["holds"]``: one outcome per hold a prefill rank ended."""

    def __post_init__(self) -> None:
        self.data.setdefault("handovers", [])
        self.data.setdefault("holds", [])

    def reset(self) -> None:
        self.data.clear()
        self.data["handovers"] = []
        self.data["holds"] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in ("handovers", "holds"):
            self.data[key] = [*self.data.get(key, []), *other.data.get(key, [])]
        return self

    def reduce(self) -> dict[str, int | float]:
        rows = self.data["handovers"]
        done = [row for row in rows if row[2] != "failed"]
        return {
            "Handovers": len(rows),
            "Failed": len(rows) - len(done),
            "MB moved": round(sum(row[3] for row in done) / 1e6, 3),
            "Holds expired": sum(
                1 for outcome in self.data.get("holds", []) if outcome == "expired"
            ),
        }

    def is_empty(self) -> bool:
        return not self.data["handovers"] and not self.data.get("holds")


class HandoverNotes:
    """A rank's notes of resolved handles, taken each step (``take``); listener-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: list[list[Any]] = []
        self._holds: list[str] = []

    def note(self, handle: Handle) -> None:
        """``Worker.add_listener`` hook: runs on the progress thread, so it only appends."""
        row = [handle.peer, handle.side, handle.state, handle.bytes, handle.duration_s or 0.0]
        with self._lock:
            self._rows.append(row)

    def held(self, outcomes: list[str]) -> None:
        """A prefill rank freed held requests, each for the outcome named."""
        with self._lock:
            self._holds.extend(outcomes)

    def take(self) -> KvplaneConnectorStats | None:
        with self._lock:
            rows, self._rows = self._rows, []
            holds, self._holds = self._holds, []
        if not rows and not holds:
            return None
        return KvplaneConnectorStats(data={"handovers": rows, "holds": holds})


class KvplanePromMetrics(KVConnectorPromMetrics):
    """The Prometheus series above, per vLLM engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.handovers = self._counter_cls(
            name="vllm:kvplane_handovers",
            documentation="kvplane handovers resolved, by peer instance, side and outcome",
            labelnames=[*labelnames, "peer", "side", "outcome"],
        )
        self.bytes = self._counter_cls(
            name="vllm:kvplane_bytes",
            documentation="Bytes of completed kvplane handovers, by peer instance and side",
            labelnames=[*labelnames, "peer", "side"],
        )
        self.seconds = self._histogram_cls(
            name="vllm:kvplane_handover_seconds",
            documentation="From send/expect to a kvplane handover's outcome",
            buckets=list(SECONDS_BUCKETS),
            labelnames=[*labelnames, "peer", "side"],
        )
        self.holds = self._counter_cls(
            name="vllm:kvplane_holds",
            documentation="Requests a prefill held for a decode, by what freed their blocks "
            "(sent, refused, released, routeless, expired)",
            labelnames=[*labelnames, "outcome"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for peer, side, outcome, nbytes, seconds in transfer_stats_data.get("handovers", []):
            self.handovers.labels(*engine, peer, side, outcome).inc()
            self.seconds.labels(*engine, peer, side).observe(float(seconds))
            if outcome != "failed":
                self.bytes.labels(*engine, peer, side).inc(int(nbytes))
        for outcome in transfer_stats_data.get("holds", []):
            self.holds.labels(*engine, str(outcome)).inc()
