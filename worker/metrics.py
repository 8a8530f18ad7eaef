"""Prometheus metrics of one block server, served on ``--metrics-port`` (0, the default: not served).

Two kinds of numbers, read two ways:

- state — sessions, KV-cache token slots used and free, open streams — is read from the handlers when
  Prometheus scrapes (a collector over ``handlers()``), so it is never stale and costs nothing per step;
- events — step latency, tokens processed — are counted where the steps run (``BlockHandler`` calls
  ``observe_step``), in counters that survive a rebalance: a moved server builds a new handler, and a
  counter kept in a handler would start again from zero.

Its own ``CollectorRegistry``, so several servers in one process (tests) do not clash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

__all__ = ["WorkerMetrics"]

#: one step of one span: sub-millisecond for a tiny model on loopback, seconds for a long prefill
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class _HandlerState(Collector):
    """Gauges read from the live handlers at scrape time."""

    def __init__(self, handlers: Callable[[], Sequence[Any]]):
        self.handlers = handlers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        handlers = list(self.handlers())
        sessions = GaugeMetricFamily(
            "swarmserve_worker_sessions", "Sessions holding KV caches on this server", labels=["state"]
        )
        used = GaugeMetricFamily("swarmserve_worker_cache_tokens_used", "KV-cache token slots in use")
        free = GaugeMetricFamily("swarmserve_worker_cache_tokens_free", "KV-cache token slots left")
        streams = GaugeMetricFamily("swarmserve_worker_active_streams", "Inference streams open")
        blocks = GaugeMetricFamily(
            "swarmserve_worker_blocks", "Blocks served by the current span", labels=["start", "end"]
        )
        attached = detached = tokens_used = tokens_free = active = 0
        for h in handlers:
            stats = h.caches.stats()
            attached += stats["sessions_attached"]
            detached += stats["sessions_detached"]
            tokens_used += stats["cache_tokens_used"]
            tokens_free += stats["cache_tokens_left"]
            active += h.active_streams
        sessions.add_metric(["attached"], attached)
        sessions.add_metric(["detached"], detached)
        used.add_metric([], tokens_used)
        free.add_metric([], tokens_free)
        streams.add_metric([], active)
        if handlers:
            current = handlers[0]
            blocks.add_metric([str(current.start), str(current.end)], current.end - current.start)
        yield from (sessions, used, free, streams, blocks)


class WorkerMetrics:
    """A block server's metrics; ``handlers`` returns its handlers, the current one first."""

    def __init__(self, handlers: Callable[[], Sequence[Any]] = tuple):
        self.registry = CollectorRegistry()
        self.registry.register(_HandlerState(handlers))
        self.step_seconds = Histogram(
            "swarmserve_worker_step_seconds",
            "Compute time of one request through this server's blocks, by RPC",
            ["rpc"],
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        self.tokens_processed = Counter(
            "swarmserve_worker_tokens_processed",
            "Tokens (batch × length) pushed through this server's blocks, by RPC",
            ["rpc"],
            registry=self.registry,
        )
        self._server: Any = None

    def observe_step(self, rpc: str, seconds: float, tokens: int) -> None:
        self.step_seconds.labels(rpc).observe(seconds)
        self.tokens_processed.labels(rpc).inc(tokens)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP from a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
