"""The Redis contract between replicas (writers) and routers (readers). Torch-free.

Keys (``{ns}`` is the namespace, ``pm`` by default, so several clusters can share one Redis):

- ``{ns}:replicas`` SET of replica ids that ever registered. Readers drop ids whose lease is
  gone (and delete that replica's block set), so a dead replica never steers routing.
- ``{ns}:lease:{id}`` HASH, the lease: ``address`` (host:port for gRPC), ``http_address``
  (host:port or empty), ``model``, ``block_size``, ``hash_scheme``, ``epoch`` (fresh random per
  process start), ``started_at``, plus load fields refreshed at least every 200 ms:
  ``running``, ``waiting``, ``kv_usage`` (0..1), ``queued_tokens`` (prompt tokens still to
  prefill plus tokens still to decode, as the engine estimates), ``num_blocks``,
  ``updated_at`` (unix seconds), and where the replica fetches KV blocks from peers
  ``fetch_cost`` (seconds to fetch one prompt token's KV over seconds to prefill it, as it has
  measured them; the router prices a prefix held elsewhere with it). PEXPIRE ``LEASE_TTL_MS`` on every refresh: the lease disappears
  within 3 s of the process dying.
- ``{ns}:blocks:{id}`` SET of the 16-byte block hashes (raw bytes) the replica holds in its
  prefix cache. Kept exact by stored/removed events, batched per engine step. PEXPIRE
  ``BLOCKS_TTL_MS`` on every lease refresh, so a dead replica's set vanishes even if no router
  ever cleans it up. After Redis or the replica restarts, the replica rewrites the whole set.
- ``{ns}:blocks_epoch:{id}`` STRING: the epoch whose full resync the block set reflects.
  A replica that finds it missing or different (Redis restart, new process) resyncs.
- ``{ns}:kv_events`` STREAM of block set changes, appended in the same MULTI as each change
  (``prefixmesh/kv_events.py`` describes the entries), so that routers keep an in-memory mirror
  of the block sets. Capped at about ``KV_EVENTS_MAXLEN`` entries, PEXPIRE ``BLOCKS_TTL_MS``
  on every append. The lease's ``kv_seq`` field is the replica's last event number.

Router-owned keys (the router module documents their fields): predicted entries for bursts
and in-flight token counts shared between routers all live under ``{ns}:router:...``.
"""

from __future__ import annotations

DEFAULT_NAMESPACE = "pm"
LEASE_TTL_MS = 3000
BLOCKS_TTL_MS = 10_000
LOAD_REFRESH_S = 0.1
KV_EVENTS_MAXLEN = 100_000


def replicas_key(ns: str = DEFAULT_NAMESPACE) -> str:
    return f"{ns}:replicas"


def lease_key(replica_id: str, ns: str = DEFAULT_NAMESPACE) -> str:
    return f"{ns}:lease:{replica_id}"


def blocks_key(replica_id: str, ns: str = DEFAULT_NAMESPACE) -> str:
    return f"{ns}:blocks:{replica_id}"


def blocks_epoch_key(replica_id: str, ns: str = DEFAULT_NAMESPACE) -> str:
    return f"{ns}:blocks_epoch:{replica_id}"


def kv_events_key(ns: str = DEFAULT_NAMESPACE) -> str:
    return f"{ns}:kv_events"
