"""The router's configuration: one typed object built from CLI flags and environment variables.

Every knob is a flag (``--policy``) and an environment variable of the same name
(``PREFIXMESH_POLICY``); a flag wins over the environment, which wins over the default.
``prefixmesh router --help`` lists every knob with its default.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from dataclasses import dataclass, field

from prefixmesh import limits, settings, tenants, tls
from prefixmesh.request_defaults import DEFAULT_MAX_TOKENS
from router.policy import (
    COLD_BY,
    COLD_REQUEST_EPSILON,
    DUPLICATE_WEIGHT,
    POLICIES,
    SATURATION_TOKENS,
    fetch_knob,
)

_LIMITS = limits.RequestLimits()
MAP_SOURCES = ("mirror", "redis")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything one router process needs: network, Redis, policy and failure knobs."""

    host: str = "127.0.0.1"
    port: int = 50050
    redis: str = "redis://127.0.0.1:6379/0"
    namespace: str = "pm"
    router_id: str = ""
    policy: str = "cache_aware"
    map_source: str = "mirror"
    metrics_port: int = 0
    # OpenAI HTTP front door and API keys (prefixmesh/openai/http.py, prefixmesh/auth.py);
    # keys stay out of repr() so a logged config never shows them.
    http_port: int = 0
    api_key: str = field(default="", repr=False)
    replica_api_key: str = field(default="", repr=False)
    # Request limits (prefixmesh/limits.py), tenant caps (prefixmesh/tenants.py) and TLS
    # (prefixmesh/tls.py): defaults written down once, in those modules.
    max_n: int = _LIMITS.max_n
    max_stop: int = _LIMITS.max_stop
    max_stop_len: int = _LIMITS.max_stop_len
    max_id_len: int = _LIMITS.max_id_len
    max_priority: int = _LIMITS.max_priority
    max_message_bytes: int = _LIMITS.max_message_bytes
    retry_after_s: float = _LIMITS.retry_after_s
    tenant_max_concurrent: int = 0
    tenant_max_queued_tokens: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    tls_ca: str = ""
    # Cost model and load bound (docs/router.md explains them).
    balance_epsilon: float = 2.0
    balance_slack_tokens: int = 512
    balance_requests_epsilon: float = 0.25
    balance_cold_requests_epsilon: float = COLD_REQUEST_EPSILON
    balance_window: int = 256
    cold_by: str = "content"
    cold_content_window: int = 1 << 16
    tie_tokens: int = 32
    prefill_weight: float = 8.0
    fetch_weight: str = "off"
    saturation_tokens: int = SATURATION_TOKENS
    duplicate_weight: float = DUPLICATE_WEIGHT
    predicted_ttl_ms: int = 5000
    predicted_settle_ms: int = 1000
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    # Discovery and shared state.
    discovery_interval_s: float = 0.25
    state_refresh_s: float = 0.1
    inflight_flush_s: float = 0.1
    inflight_ttl_ms: int = 3000
    redis_timeout_s: float = 0.5
    dead_grace_s: float = 1.0
    # Failure handling.
    max_attempts: int = 3
    keepalive_s: float = 30.0
    log_level: str = "INFO"

    def resolved_replica_api_key(self) -> str:
        """The key sent to replicas: ``--replica-api-key``, else ``--api-key`` (so one
        ``PREFIXMESH_API_KEY`` for a whole cluster covers both hops)."""
        return self.replica_api_key or self.api_key

    def resolved_router_id(self) -> str:
        """The id other routers see in Redis (default: hostname-pid-random, unique per process)."""
        return self.router_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


_HELP: dict[str, str] = {
    "host": "interface to bind the gRPC server on",
    "port": "gRPC port (0 = pick a free one)",
    "redis": "Redis URL where replicas hold their leases and block sets",
    "namespace": "prefix of every Redis key (must match the replicas')",
    "router_id": "id of this router in Redis (default: host-pid-<random>)",
    "policy": "routing policy: " + ", ".join(POLICIES),
    "map_source": "where a routing decision reads the block map: 'mirror' (an in-memory copy "
    "kept from the replicas' KV event stream in Redis, no round trip per request) or 'redis' "
    "(one Lua round trip per request)",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "http_port": "OpenAI-compatible HTTP port: /v1/completions, /v1/chat/completions, "
    "/v1/models, /health, /metrics (0 = off)",
    "api_key": "if set, HTTP /v1/* needs 'Authorization: Bearer <key>' and gRPC calls "
    "(but health and reflection) need metadata 'authorization: Bearer <key>'",
    "replica_api_key": "key sent to the replicas (their --api-key) as gRPC metadata "
    "'authorization: Bearer <key>' on every call; empty = --api-key",
    "balance_epsilon": "load bound: a replica whose load would exceed (1 + epsilon) x mean "
    "load + slack is skipped (load = outstanding tokens, docs/router.md)",
    "balance_slack_tokens": "load (tokens) below which the bound never bites, so a burst on "
    "an idle cluster stays together",
    "balance_requests_epsilon": "request bound: a replica whose share of this router's last "
    "--balance-window decisions would exceed (1 + epsilon) x the mean (+ 2 requests) is "
    "skipped, so a hot prefix spills over to a second replica (0.25 keeps max/mean requests "
    "near 1.25; negative = off); it starts once the window holds 32 decisions",
    "balance_cold_requests_epsilon": "the request bound's epsilon for a replica where the "
    "request would hit nothing (never above --balance-requests-epsilon): cold requests keep "
    "within (1 + this) x the mean share, leaving a replica that holds hot prefixes headroom "
    "for their warm requests (at or above --balance-requests-epsilon: no difference)",
    "balance_window": "routing decisions over which the request bound counts requests",
    "cold_by": "where a prompt no replica holds goes: 'content' (the replica this router has "
    "sent the fewest distinct prompt blocks lately, so every pool turns over at the same rate; "
    "within the request bound, and not to a replica loaded beyond 8 x the least loaded's + "
    "16,384 tokens) or 'load' (the cheapest, i.e. the least loaded)",
    "cold_content_window": "with --cold-by content: distinct (replica, block) pairs per epoch "
    "of the content count, which covers the current epoch and the one before (bounds memory: "
    "a replica that joins late catches up within two epochs)",
    "tie_tokens": "costs within this many tokens count as equal; ties go to the replica the "
    "prefix hashes to (rendezvous), the same on every router",
    "prefill_weight": "cost of one uncached prompt token relative to one queued token: a miss "
    "costs the whole cluster (the prefix is computed and stored again), a queue only delays",
    "fetch_weight": "cost of one prompt token another replica holds, which the chosen replica "
    "can fetch from it (docs/fetch.md), in the units of --prefill-weight: auto = the prefill "
    "weight times what fetching a token costs that replica against prefilling it, as it "
    "measures and publishes in its lease (a replica that does not fetch: a full prefill); "
    "a number = that weight for every replica; off = such tokens cost a full prefill",
    "saturation_tokens": "the cluster is saturated while every replica has at least this many "
    "tokens queued (load, as for --balance-epsilon); then --duplicate-weight applies",
    "duplicate_weight": "under saturation, the extra cost of one prompt token that another "
    "replica holds or is computing on a replica that would compute it again, in the units of "
    "--prefill-weight's queued tokens (0 = off): a hot prefix stays on its busy replica "
    "instead of being computed twice while every queue is long",
    "predicted_ttl_ms": "how long a routing decision counts as 'this replica will hold the "
    "prefix' before the replica's own KV events confirm it (renewed while the request waits "
    "for its first token)",
    "predicted_settle_ms": "how long a request's predicted entries stay once the replica has "
    "prefilled it (its first token) or it ended: time for the replica's KV events to reach the "
    "map, which then says what the replica still holds (with the mirror, an entry goes as soon "
    "as the replica announces its block)",
    "default_max_tokens": "max_tokens assumed for load when a request sets none (the "
    "replica's default)",
    "discovery_interval_s": "how often the lease list is re-read from Redis",
    "state_refresh_s": "with --map-source mirror: how often leases, load and other routers' "
    "in-flight tokens are read from Redis and the mirror is checked against it",
    "inflight_flush_s": "how often this router publishes its in-flight tokens to Redis",
    "inflight_ttl_ms": "TTL of the published in-flight tokens (a dead router's vanish)",
    "redis_timeout_s": "socket timeout of Redis calls; beyond it the router falls back to "
    "its local view",
    "dead_grace_s": "a replica that failed a connection stays out until its lease is "
    "refreshed this long after the failure (or its epoch changes)",
    "max_attempts": "after this many replica failures (retries + failovers) in one request, "
    "the error goes to the client",
    "keepalive_s": "gRPC keepalive ping interval on busy replica channels (finds a host that "
    "vanished without closing its connections)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    **limits.HELP,
    **tenants.HELP,
    **tls.HELP,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``prefixmesh router`` argument parser; defaults already include the environment."""
    return settings.build_parser(
        RouterConfig,
        _HELP,
        prog="prefixmesh router",
        description="Serve the KV-cache-aware router over gRPC (Generator + Cluster services, "
        "health, reflection). Replicas are discovered through their Redis leases.",
        secret_fields=("api_key", "replica_api_key"),
    )


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    """Build the config from ``argv`` (flags) and ``os.environ`` (``PREFIXMESH_*``)."""
    config = settings.parse(RouterConfig, build_parser(), argv)
    problems = []
    if config.policy not in POLICIES:
        problems.append(f"--policy must be one of {', '.join(POLICIES)} (got {config.policy!r})")
    if config.map_source not in MAP_SOURCES:
        problems.append(
            f"--map-source must be one of {', '.join(MAP_SOURCES)} (got {config.map_source!r})"
        )
    try:
        fetch_knob(config.fetch_weight)
    except ValueError:
        problems.append(
            f"--fetch-weight must be auto, off or a number >= 0 (got {config.fetch_weight!r})"
        )
    if config.state_refresh_s <= 0:
        problems.append(f"--state-refresh-s must be > 0 (got {config.state_refresh_s})")
    if not 0 <= config.port < 65536:
        problems.append(f"--port must be in [0, 65535] (got {config.port})")
    if config.balance_epsilon < 0:
        problems.append(f"--balance-epsilon must be >= 0 (got {config.balance_epsilon})")
    if config.saturation_tokens < 0:
        problems.append(f"--saturation-tokens must be >= 0 (got {config.saturation_tokens})")
    if config.duplicate_weight < 0:
        problems.append(f"--duplicate-weight must be >= 0 (got {config.duplicate_weight})")
    if config.cold_by not in COLD_BY:
        problems.append(f"--cold-by must be one of {', '.join(COLD_BY)} (got {config.cold_by!r})")
    if config.cold_content_window < 1:
        problems.append(f"--cold-content-window must be >= 1 (got {config.cold_content_window})")
    if config.balance_window < 1:
        problems.append(f"--balance-window must be >= 1 (got {config.balance_window})")
    if config.max_attempts < 1:
        problems.append(f"--max-attempts must be >= 1 (got {config.max_attempts})")
    if config.predicted_ttl_ms < 1:
        problems.append(f"--predicted-ttl-ms must be >= 1 (got {config.predicted_ttl_ms})")
    if config.predicted_settle_ms < 0:
        problems.append(f"--predicted-settle-ms must be >= 0 (got {config.predicted_settle_ms})")
    problems += limits.check_limits(limits.RequestLimits.from_config(config))
    problems += tls.TlsFiles.from_config(config).problems()
    if problems:
        raise SystemExit("prefixmesh router: " + "; ".join(problems))
    return config
