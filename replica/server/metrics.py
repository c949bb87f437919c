"""Prometheus metrics of one replica, named for what an operator asks.

Latency histograms are observed by the gRPC servicer as requests stream. Engine counters and
gauges (prefix cache, KV usage, running/waiting, preemptions, finish reasons) are read from the
engine's latest ``EngineStats`` snapshot at scrape time, so they can never drift from the engine.
Each server owns its own ``CollectorRegistry``: several replicas can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from replica.engine import EngineStats

PREFIX = "prefixmesh"

# Seconds; CPU serving spans milliseconds (decode steps) to minutes (queued long prompts).
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineStatsCollector(Collector):
    """Turns the engine's cumulative stats snapshot into Prometheus samples at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        if s is None:
            return
        yield self._gauge("num_requests_running", "Requests in the running batch", s.running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled", s.waiting)
        yield self._gauge("kv_cache_usage", "Fraction of KV cache blocks in use (0..1)", s.kv_usage)
        yield self._gauge("kv_cache_blocks_total", "KV cache blocks in the pool", s.num_blocks)
        yield self._gauge(
            "kv_cache_blocks_free", "KV cache blocks not referenced by a request", s.free_blocks
        )
        yield self._gauge("prefix_cache_blocks", "Blocks held in the prefix cache", s.cached_blocks)
        yield self._gauge("queued_tokens", "Prefill plus decode tokens still owed", s.queued_tokens)
        yield self._gauge(
            "prefix_cache_kept_blocks",
            "Prefix blocks waiting requests keep (evicted only after every other cached block)",
            s.kept_hashes,
        )
        yield self._counter(
            "prefix_cache_kept_evictions",
            "Kept prefix blocks evicted all the same because no other cached block was left",
            s.kept_evictions,
        )
        yield self._counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_cache_queries,
        )
        yield self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits
        )
        yield self._counter("preemptions", "Requests preempted to free KV blocks", s.preemptions)
        yield from self._preemption(s)
        yield self._counter("prompt_tokens", "Prompt tokens processed", s.prompt_tokens)
        yield self._counter("generation_tokens", "Tokens generated", s.generation_tokens)
        finished = CounterMetricFamily(
            f"{PREFIX}_requests_finished",
            "Finished samples by finish reason",
            labels=[*self._labels, "finish_reason"],
        )
        for reason, count in sorted(dict(s.finished_by_reason).items()):
            finished.add_metric([*self._labels.values(), reason], count)
        yield finished

    def _preemption(self, s: EngineStats) -> Iterator[Any]:
        p = s.preempt
        kinds = CounterMetricFamily(
            f"{PREFIX}_preemptions_by_kind", "Preemptions by kind (recompute or swap)",
            labels=[*self._labels, "kind"],
        )  # fmt: skip
        kinds.add_metric([*self._labels.values(), "recompute"], p.recompute_preemptions)
        kinds.add_metric([*self._labels.values(), "swap"], p.swap_preemptions)
        yield kinds
        yield self._counter(
            "recomputed_tokens", "Tokens computed again after recompute preemptions",
            p.recomputed_tokens,
        )  # fmt: skip
        yield self._counter("swapped_out_blocks", "KV blocks swapped out", p.swapped_out_blocks)
        yield self._counter("swapped_in_blocks", "KV blocks swapped back in", p.swapped_in_blocks)
        yield self._counter(
            "queue_time_seconds", "Time sequences waited to be admitted, summed", p.queue_time_s
        )
        yield self._counter("admissions", "Admissions summed in queue_time_seconds", p.admissions)


class ReplicaMetrics:
    """One replica's metrics in its own registry; ``serve(port)`` exposes ``/metrics``."""

    def __init__(
        self, stats: Callable[[], EngineStats | None], model: str, replica_id: str
    ) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model, "replica": replica_id}
        names, values = list(labels), list(labels.values())

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(f"{PREFIX}_{name}", doc, names, buckets=buckets, registry=self.registry)
            return h.labels(*values)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Gap between successive tokens of a sample", _ITL_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Arrival until the engine first schedules the request",
            _LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds",
            "Arrival to the last token of the request",
            _LATENCY_BUCKETS,
        )
        # KV transfers between replicas (replica/fetch/client.py, replica/fetch/holder.py).
        self.fetched_tokens = Counter(
            f"{PREFIX}_fetched_tokens", "Prompt tokens whose KV was fetched from a peer replica",
            names, registry=self.registry,
        ).labels(*values)  # fmt: skip
        self.fetched_bytes = Counter(
            f"{PREFIX}_kv_fetch_bytes", "KV bytes received from peer replicas",
            names, registry=self.registry,
        ).labels(*values)  # fmt: skip
        self._fetches = Counter(
            f"{PREFIX}_kv_fetches",
            "Fetch decisions by outcome: fetched, timeout, failed (then recomputed), "
            "skipped_cost (recomputing was cheaper)",
            [*names, "outcome"], registry=self.registry,
        )  # fmt: skip
        self._labels = values
        self.blocks_served = Counter(
            f"{PREFIX}_kv_blocks_served", "KV blocks streamed to peer replicas",
            names, registry=self.registry,
        ).labels(*values)  # fmt: skip
        self.registry.register(_EngineStatsCollector(stats, labels))
        self._http: Any = None

    def count_fetch(self, outcome: str, tokens: int = 0, num_bytes: int = 0) -> None:
        """One fetch decision, and what it brought."""
        self._fetches.labels(*self._labels, outcome).inc()
        self.fetched_tokens.inc(tokens)
        self.fetched_bytes.inc(num_bytes)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the ``/metrics`` HTTP endpoint in a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
