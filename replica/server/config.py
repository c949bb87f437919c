"""The replica server's configuration: one typed object built from CLI flags and environment.

Every knob is a flag (``--max-queue``) and an environment variable of the same name
(``PREFIXMESH_MAX_QUEUE``); a flag wins over the environment, which wins over the default.
``prefixmesh replica --help`` lists every knob with its default.
"""

from __future__ import annotations

import argparse
import secrets
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixmesh import limits, settings, tenants, tls
from prefixmesh.eviction import DEFAULT_EVICTION, EVICTION_POLICIES

if TYPE_CHECKING:
    from replica.config import EngineConfig


_LIMITS = limits.RequestLimits()


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything one replica process needs: network, Redis, engine and operations knobs."""

    host: str = "127.0.0.1"
    port: int = 50051
    advertise_address: str = ""
    advertise_host: str = ""
    replica_id: str = ""
    redis: str = ""
    namespace: str = "pm"
    model: str = "smollm2"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int = 0
    kv_cache_gb: float = 1.0
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int = 0
    max_queue: int = 256
    threads: int = 0
    metrics_port: int = 0
    http_port: int = 0  # OpenAI-compatible HTTP (prefixmesh/openai/http.py)
    api_key: str = field(default="", repr=False)  # prefixmesh/auth.py; never in a log line
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
    grace_period: float = 10.0
    # Fetch-on-miss (replica/fetch/client.py): a peer's KV blocks instead of a prefill.
    fetch: bool = True
    fetch_timeout: float = 10.0
    fetch_min_blocks: int = 1
    fetch_mb_per_s: float = 200.0
    fetch_prefill_tokens_per_s: float = 1000.0
    warm_start_share: float = 0.0  # replica/fetch/warm_start.py; 0: off
    attention_backend: str = "auto"
    device: str = "cpu"
    scheduling_policy: str = "fcfs"
    tenant_fairness: bool = True  # replica/tenant_share.py
    tenant_prefill_chunk: int = 0
    tenant_window_s: float = 10.0
    prefix_caching: bool = True
    wait_for_inflight_prefix: bool = True
    waiting_prefix_share: float = 1.0
    eviction: str = DEFAULT_EVICTION  # prefixmesh/eviction.py
    batch_invariant: bool = False
    seed: int = 0
    log_level: str = "INFO"
    kv_events: str = ""  # replica/server/zmq_events.py: vLLM-format events over ZMQ

    def resolved_advertise_address(self, bound_port: int) -> str:
        """The host:port routers should dial (``--advertise-host auto`` = this machine's name)."""
        if self.advertise_address:
            return self.advertise_address
        host = self.advertise_host or self.host
        if host == "auto":
            host = socket.gethostname()
        elif host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"{host}:{bound_port}"

    def resolved_replica_id(self, bound_port: int) -> str:
        """A stable id if given, else host-port plus a random suffix (unique per process)."""
        if self.replica_id:
            return self.replica_id
        host = self.advertise_host if self.advertise_host not in ("", "auto") else self.host
        if self.advertise_host == "auto" or host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        return f"{host}-{bound_port}-{secrets.token_hex(3)}"

    def engine_config(self) -> EngineConfig:
        """The engine's share of this configuration (0 / empty = the engine's own default)."""
        from replica.config import EngineConfig

        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": self.prefix_caching,
            "wait_for_inflight_prefix": self.wait_for_inflight_prefix,
            "waiting_prefix_share": self.waiting_prefix_share,
            "eviction": self.eviction,
            "scheduling_policy": self.scheduling_policy,
            "tenant_fairness": self.tenant_fairness,
            "tenant_prefill_chunk": self.tenant_prefill_chunk,
            "tenant_window_s": self.tenant_window_s,
            "attention_backend": self.attention_backend,
            "device": self.device,
            "seed": self.seed,
            "batch_invariant": self.batch_invariant,
        }
        if self.num_blocks:
            kwargs["num_kv_blocks"] = self.num_blocks
        kwargs["kv_cache_memory_gb"] = self.kv_cache_gb
        if self.max_model_len:
            kwargs["max_model_len"] = self.max_model_len
        if self.threads:
            kwargs["num_threads"] = self.threads
        return EngineConfig(**kwargs)


# flag -> help text. The defaults come from ServerConfig, so they are written down once.
_HELP: dict[str, str] = {
    "host": "interface to bind the gRPC server on",
    "port": "gRPC port (0 = pick a free one)",
    "advertise_address": "host:port routers dial to reach this replica (default: "
    "advertise host + bound port)",
    "advertise_host": "host part of the advertised address; 'auto' = socket.gethostname() "
    "(what a container needs); default: --host",
    "replica_id": "id in Redis and in every response (default: host-port-<random>)",
    "redis": "Redis URL for the lease and KV events, e.g. redis://127.0.0.1:6379/0 "
    "(empty = standalone, no Redis)",
    "namespace": "prefix of every Redis key, so several clusters can share one Redis",
    "model": "model name ('smollm2'), Hugging Face folder or .gguf file",
    "dtype": "weights and KV cache dtype: auto (bfloat16 on CUDA and on CPUs with AVX-512 BF16 "
    "or AMX, else float32), float32, bfloat16 or float16",
    "block_size": "tokens per KV cache block (the prefix-cache granularity)",
    "num_blocks": "KV cache blocks (0 = sized from --kv-cache-gb)",
    "kv_cache_gb": "KV cache memory in GiB; ignored if --num-blocks is set",
    "max_num_seqs": "most sequences running in one engine step",
    "max_num_batched_tokens": "token budget of one engine step (chunked prefill)",
    "max_model_len": "longest prompt + output in tokens (0 = the model's context length)",
    "max_queue": "most requests waiting to start; beyond it Generate answers RESOURCE_EXHAUSTED",
    "threads": "torch CPU threads (0 = torch default)",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "http_port": "OpenAI-compatible HTTP port: /v1/completions, /v1/chat/completions, "
    "/v1/models, /health, /metrics (0 = off)",
    "api_key": "if set, gRPC calls (but health and reflection) need metadata "
    "'authorization: Bearer <key>' and HTTP /v1/* needs 'Authorization: Bearer <key>'; "
    "routers send it with their --replica-api-key (or --api-key)",
    "grace_period": "seconds in-flight requests get to finish after SIGTERM before abort",
    "fetch": "fetch a prompt's leading KV blocks from a peer replica that holds them (named "
    "by the router's fetch hint, else found in Redis) when the cost model says that is faster "
    "than prefilling them (--no-fetch: always prefill)",
    "fetch_timeout": "seconds a fetch may take at most (less when prefilling would be quicker); "
    "past it the blocks that arrived are kept and the rest is prefilled",
    "fetch_min_blocks": "fetch only when a peer holds at least this many more leading blocks",
    "fetch_mb_per_s": "transfer speed assumed until the first fetch measures it (MB/s)",
    "fetch_prefill_tokens_per_s": "prefill speed assumed until a prefill measures it",
    "warm_start_share": "after it starts serving, pre-fetch the cluster's hottest prefixes "
    "(the blocks most peers hold in the Redis map) from a peer, up to this share of the KV "
    "pool, in the background (0: off; needs --redis and fetching)",
    "attention_backend": "attention kernels: auto, torch or triton",
    "device": "torch device: cpu or cuda",
    "scheduling_policy": "fcfs or priority (lower GenerateRequest.priority first)",
    "tenant_fairness": "share each engine step fairly across tenants (cache_salt, else API "
    "key): the least-served tenant's prefill first, the others' prefill capped per step while "
    "more than one is present (--no-tenant-fairness: FCFS / priority only); one tenant: no "
    "effect",
    "tenant_prefill_chunk": "prefill tokens per step the tenants over their fair share get "
    "between them while another tenant is present (0 = a quarter of --max-num-batched-tokens); "
    "smaller: a light tenant's first token waits less behind a heavy tenant's step",
    "tenant_window_s": "seconds a tenant counts as present after its last request",
    "prefix_caching": "reuse cached KV blocks of shared prompt prefixes (--no-prefix-caching "
    "is the baseline for measurements)",
    "wait_for_inflight_prefix": "a request whose next prompt blocks another request is "
    "prefilling right now waits for them to be cached instead of computing them again "
    "(--no-wait-for-inflight-prefix: admit it at once)",
    "waiting_prefix_share": "a waiting request keeps its cached prefix, and the blocks past it "
    "that a request queued before it will compute: those blocks are evicted only after every "
    "block no waiting request needs, up to this share of the KV pool (0 = off: the prefix is "
    "only marked used when the request arrives)",
    "eviction": "which cached block an allocation evicts: lru (least recently used) or reuse "
    "(blocks no request has found since they were cached go first, in an ARC-style adaptive "
    "share; leaves before parents); docs/notes/2026-12-08-eviction.md",
    "batch_invariant": "run every matmul in tiles of at most 32 rows so a token's result does not "
    "depend on what it is batched with: a prefix-cache hit (local or fetched from a peer) then "
    "gives the cold run's greedy output exactly in bfloat16 too; costs prefill speed on AMX "
    "CPUs (docs/fetch.md)",
    "seed": "engine seed for requests that set none",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "kv_events": "also publish KV cache events in vLLM's format (msgpack over ZMQ PUB, replay "
    "on the next port) for Dynamo / llm-d style schedulers, e.g. zmq://*:5557 (empty = off; the "
    "Redis path is unchanged)",
    **limits.HELP,
    **tenants.HELP,
    **tls.HELP,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``prefixmesh replica`` argument parser; defaults already include the environment."""
    return settings.build_parser(
        ServerConfig,
        _HELP,
        prog="prefixmesh replica",
        description="Serve one model replica over gRPC (Generator + Replica services, health, "
        "reflection), registered in Redis with its KV cache contents.",
        secret_fields=("api_key",),
    )


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Build the config from ``argv`` (flags) and ``os.environ`` (``PREFIXMESH_*``)."""
    config = settings.parse(ServerConfig, build_parser(), argv)
    _check(config)
    return config


def _check(config: ServerConfig) -> None:
    problems = []
    if not 0 <= config.port < 65536:
        problems.append(f"--port must be in [0, 65535] (got {config.port})")
    if config.max_queue < 1:
        problems.append(f"--max-queue must be >= 1 (got {config.max_queue})")
    if config.grace_period < 0:
        problems.append(f"--grace-period must be >= 0 (got {config.grace_period})")
    if config.fetch_timeout <= 0 or config.fetch_mb_per_s <= 0:
        problems.append("--fetch-timeout and --fetch-mb-per-s must be > 0")
    if config.fetch_prefill_tokens_per_s <= 0:
        problems.append("--fetch-prefill-tokens-per-s must be > 0")
    if not 0 <= config.warm_start_share <= 1:
        problems.append(f"--warm-start-share must be in [0, 1] (got {config.warm_start_share})")
    if not 0 <= config.waiting_prefix_share <= 1:
        problems.append(
            f"--waiting-prefix-share must be in [0, 1] (got {config.waiting_prefix_share})"
        )
    if config.eviction not in EVICTION_POLICIES:
        problems.append(
            f"--eviction must be one of {', '.join(EVICTION_POLICIES)} (got {config.eviction!r})"
        )
    if config.block_size < 1:
        problems.append(f"--block-size must be >= 1 (got {config.block_size})")
    problems += limits.check_limits(limits.RequestLimits.from_config(config))
    problems += tls.TlsFiles.from_config(config).problems()
    if problems:
        raise SystemExit("prefixmesh replica: " + "; ".join(problems))
