"""Router metrics: Prometheus collectors (one registry per server) and the resettable routing
statistics the Cluster service reports.

Prometheus counters only grow (``ResetStats`` leaves them alone); ``RoutingCounters`` is the
window since the last ``ResetStats``, which is what ``loadtest --compare`` reads per policy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PromCounter

_OVERHEAD_BUCKETS = (
    0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0008, 0.001, 0.0015,
    0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class RoutingCounters:
    """Routing decisions and token counts since the last reset (all replicas together)."""

    decisions: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    prompt_tokens: int = 0
    retries: int = 0
    failovers: int = 0
    errors: int = 0

    @property
    def hit_rate(self) -> float:
        return self.actual_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Children(dict[str, Any]):
    """A one-label metric's children by label value, looked up once each: ``labels()`` takes a
    lock and builds a tuple on every call, on the request path several times per request."""

    def __init__(self, metric: Any) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, value: str) -> Any:
        child = self[value] = self.metric.labels(value)
        return child


class RouterMetrics:
    """Every number the router exports; ``serve(port)`` exposes them on /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.window = RoutingCounters()
        r = self.registry
        self.requests = PromCounter(
            "router_requests", "Requests routed, by decision outcome", ["outcome"], registry=r
        )
        self.replica_requests = PromCounter(
            "router_replica_requests", "Requests sent to each replica", ["replica"], registry=r
        )
        self.prompt_tokens = PromCounter(
            "router_prompt_tokens", "Prompt tokens of finished samples", ["replica"], registry=r
        )
        self.cached_tokens = PromCounter(
            "router_cached_tokens",
            "Prompt tokens the replica served from its prefix cache",
            ["replica"],
            registry=r,
        )
        self.predicted_cached_tokens = PromCounter(
            "router_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen replica to have cached",
            registry=r,
        )
        self.retries = PromCounter(
            "router_retries", "Requests re-routed before their first token", registry=r
        )
        self.failovers = PromCounter(
            "router_failovers", "Streams resumed on another replica mid-stream", registry=r
        )
        self.errors = PromCounter(
            "router_errors", "Requests that ended in an error", ["code"], registry=r
        )
        self.replica_failures = PromCounter(
            "router_replica_failures", "Calls that failed to reach a replica", ["replica"],
            registry=r,
        )  # fmt: skip
        self.overhead = Histogram(
            "router_overhead_seconds",
            "Request arrival to upstream call issued (tokenize, hash, Redis lookup, policy)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.lookup = Histogram(
            "router_redis_lookup_seconds", "Lua prefix lookup round trip",
            buckets=_OVERHEAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "router_time_to_first_token_seconds", "Request arrival to first token forwarded",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "router_inflight_tokens", "Tokens this router has outstanding per replica",
            ["replica"], registry=r,
        )  # fmt: skip
        self.replicas = Gauge("router_live_replicas", "Replicas in the routing set", registry=r)
        self.redis_up = Gauge("router_redis_up", "1 while Redis answers", registry=r)
        self.prompt_blocks = PromCounter(
            "router_prompt_blocks",
            "Cacheable prompt blocks by fate: hit, compulsory, evicted, elsewhere, stale "
            "(router/attribution.py)",
            ["kind"],
            registry=r,
        )
        self._by_outcome = _Children(self.requests)
        self._by_replica = _Children(self.replica_requests)
        self._prompt_by_replica = _Children(self.prompt_tokens)
        self._cached_by_replica = _Children(self.cached_tokens)
        self.blocks_by_kind = _Children(self.prompt_blocks)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    # -- events ---------------------------------------------------------------------------

    def routed(self, outcome: str, replica_id: str, predicted_cached: int) -> None:
        self.window.decisions[outcome] += 1
        self.window.requests += 1
        self.window.predicted_cached_tokens += predicted_cached
        self._by_outcome[outcome].inc()
        self._by_replica[replica_id].inc()
        self.predicted_cached_tokens.inc(predicted_cached)

    def finished(self, replica_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.window.prompt_tokens += prompt_tokens
        self.window.actual_cached_tokens += cached_tokens
        self._prompt_by_replica[replica_id].inc(prompt_tokens)
        self._cached_by_replica[replica_id].inc(cached_tokens)

    def retried(self, replica_id: str) -> None:
        self.window.retries += 1
        self.retries.inc()
        self.replica_failures.labels(replica_id).inc()

    def failed_over(self, replica_id: str) -> None:
        self.window.failovers += 1
        self.failovers.inc()
        self.replica_failures.labels(replica_id).inc()

    def error(self, code: str) -> None:
        self.window.errors += 1
        self.errors.labels(code).inc()

    def reset_window(self) -> None:
        self.window = RoutingCounters()
