"""The router's local view of the replicas, fed only by their Redis leases.

A replica appears when its lease shows up in a lookup (the per-request Lua call or the
background refresh every ``discovery_interval_s``) and disappears when the lease is gone. A
replica the router fails to reach is marked dead at once and stays out until its lease shows
it alive again: a new epoch (restarted process) or a refresh ``dead_grace_s`` after the
failure. The view is also the fallback when Redis is down: the replicas listed last, with their
last known load.

Per replica it keeps one gRPC channel (reused by every request), the router's own in-flight
counts and the per-replica statistics the Cluster service reports. Tokenizers are fetched once
per (model, block_size) from the first replica serving it (``Replica.GetModelInfo``). Every call
to a replica carries ``metadata`` (the router's replica API key, if any).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from prefixmesh.auth import bearer_metadata
from prefixmesh.hashing import HASH_SCHEME
from prefixmesh.tls import TlsFiles, aio_channel
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the tokenizer loads lazily, on the first replica of a model
    from prefixmesh.tokenizer import Tokenizer

log = logging.getLogger("prefixmesh.router")

GROUP_KEY = tuple[str, int]  # (model id, block size): replicas that share block hashes
_MAX_MESSAGE = 64 * 1024 * 1024  # tokenizer.json travels in ModelInfo
_CLOSE_UNLISTED_AFTER_S = 30.0


@dataclass(frozen=True, slots=True)
class Lease:
    """A replica's lease hash (``prefixmesh/redis_layout.py``), parsed leniently."""

    address: str = ""
    http_address: str = ""
    model: str = ""
    block_size: int = 0
    hash_scheme: str = ""
    epoch: str = ""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    queued_tokens: int = 0
    num_blocks: int = 0
    updated_at: float = 0.0
    cached_blocks: int = 0  # blocks in the replica's prefix cache (its block set's size)
    fetch_cost: float = -1.0  # a fetched prompt token's cost / a prefilled one's; < 0: no fetch
    free_blocks: int = 0  # blocks an allocation can take: empty ones plus evictable cached ones

    @property
    def empty_blocks(self) -> int | None:
        """Blocks holding nothing, at least (None: the lease does not say): free blocks that
        are not cached ones. It counts short by the cached blocks running requests hold."""
        if self.num_blocks <= 0:
            return None
        return max(0, self.free_blocks - self.cached_blocks)

    @classmethod
    def from_fields(cls, f: Mapping[str, str]) -> Lease:
        return cls(
            address=f.get("address", ""),
            http_address=f.get("http_address", ""),
            model=f.get("model", ""),
            block_size=int(_num(f, "block_size")),
            hash_scheme=f.get("hash_scheme", ""),
            epoch=f.get("epoch", ""),
            running=int(_num(f, "running")),
            waiting=int(_num(f, "waiting")),
            kv_usage=_num(f, "kv_usage"),
            queued_tokens=int(_num(f, "queued_tokens")),
            num_blocks=int(_num(f, "num_blocks")),
            updated_at=_num(f, "updated_at"),
            cached_blocks=int(_num(f, "cached_blocks")),
            fetch_cost=_num(f, "fetch_cost") if f.get("fetch_cost") else -1.0,
            free_blocks=int(_num(f, "free_blocks")),
        )

    @property
    def group(self) -> GROUP_KEY:
        return (self.model, self.block_size)


def _num(fields: Mapping[str, str], name: str) -> float:
    try:
        return float(fields.get(name) or 0)
    except ValueError:
        return 0.0


@dataclass(slots=True)
class ReplicaStats:
    """What this router saw of one replica since the last ResetStats."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(eq=False, slots=True)
class ReplicaHandle:
    """One replica: its lease, channel, stubs and this router's counters."""

    replica_id: str
    lease: Lease
    channel: grpc.aio.Channel
    generator: pb_grpc.GeneratorStub
    admin: pb_grpc.ReplicaStub
    listed_at: float = 0.0
    dead_at: float | None = None
    inflight_tokens: int = 0
    inflight_requests: int = 0
    other_inflight_tokens: int = 0
    stats: ReplicaStats = field(default_factory=ReplicaStats)

    @property
    def alive(self) -> bool:
        return self.dead_at is None


class ReplicaView:
    """Live replicas as this router knows them, with channels and tokenizers."""

    def __init__(
        self, keepalive_s: float = 30.0, dead_grace_s: float = 1.0, api_key: str = ""
    ) -> None:
        self.handles: dict[str, ReplicaHandle] = {}
        self.listed: list[str] = []  # ids in the latest successful lookup
        self.tokenizers: dict[GROUP_KEY, Tokenizer | None] = {}
        self.model_ids: dict[GROUP_KEY, str] = {}
        self._fetching: set[GROUP_KEY] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.keepalive_s = keepalive_s
        self.dead_grace_s = dead_grace_s
        # Sent with every call to a replica; None (not ()) is what a call without any wants.
        self.metadata = bearer_metadata(api_key) or None
        self.tls: TlsFiles | None = None  # prefixmesh/tls.py: TLS to the replicas when set
        # (replica id, epoch, status code) of GetModelInfo failures already logged: a failing
        # replica is asked again every discovery round, but logged once until it answers.
        self._reported: set[tuple[str, str, str]] = set()

    # -- updates from Redis ---------------------------------------------------------------

    def apply(self, leases: Iterable[tuple[str, Lease, int]]) -> None:
        """Adopt the live set from a lookup: (replica id, lease, other routers' in-flight)."""
        now = time.monotonic()
        listed = []
        for replica_id, lease, other_inflight in leases:
            if not lease.address:
                continue  # a lease being written; the next lookup will have it
            handle = self.handles.get(replica_id)
            if handle is None or handle.lease.address != lease.address:
                handle = self._open(replica_id, lease)
            self._maybe_revive(handle, lease)
            handle.lease = lease
            handle.listed_at = now
            handle.other_inflight_tokens = other_inflight
            listed.append(replica_id)
            if lease.group not in self.tokenizers:
                self._fetch_model_info(handle)
        self.listed = listed
        self._close_unlisted(now)

    def _open(self, replica_id: str, lease: Lease) -> ReplicaHandle:
        old = self.handles.get(replica_id)
        if old is not None:
            self._spawn(old.channel.close(grace=5.0))
        options = [
            ("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        channel = aio_channel(lease.address, self.tls, options=options)
        handle = ReplicaHandle(
            replica_id=replica_id,
            lease=lease,
            channel=channel,
            generator=pb_grpc.GeneratorStub(channel),
            admin=pb_grpc.ReplicaStub(channel),
        )
        if old is not None:
            handle.stats = old.stats
        self.handles[replica_id] = handle
        log.info("replica %s at %s (model %s)", replica_id, lease.address, lease.model)
        return handle

    def _maybe_revive(self, handle: ReplicaHandle, lease: Lease) -> None:
        if handle.dead_at is None:
            return
        restarted = lease.epoch != handle.lease.epoch
        refreshed = lease.updated_at > handle.dead_at + self.dead_grace_s
        if restarted or refreshed:
            log.info("replica %s is back (epoch %s)", handle.replica_id, lease.epoch)
            handle.dead_at = None

    def _close_unlisted(self, now: float) -> None:
        for replica_id, handle in list(self.handles.items()):
            gone_for = now - handle.listed_at
            if gone_for > _CLOSE_UNLISTED_AFTER_S and handle.inflight_requests == 0:
                del self.handles[replica_id]
                self._spawn(handle.channel.close())

    def mark_dead(self, replica_id: str) -> None:
        """Stop routing to a replica at once (a connection to it failed)."""
        handle = self.handles.get(replica_id)
        if handle is not None and handle.dead_at is None:
            handle.dead_at = time.time()
            log.warning("replica %s unreachable: out of the routing set", replica_id)

    def key_refused(self, handle: ReplicaHandle) -> str:
        """``handle`` answered UNAUTHENTICATED: the error message, logged once per replica
        process. A wrong key is a deployment mistake, not a dead replica: it stays routable."""
        message = (
            f"replica {handle.replica_id} refused the router's API key: the router's "
            "--replica-api-key (else its --api-key) must be the replicas' --api-key"
        )
        if self._first_report(handle, grpc.StatusCode.UNAUTHENTICATED.name):
            log.error("%s", message)
        return message

    def _first_report(self, handle: ReplicaHandle, code: str) -> bool:
        key = (handle.replica_id, handle.lease.epoch, code)
        if key in self._reported:
            return False
        self._reported.add(key)
        return True

    # -- queries ----------------------------------------------------------------------------

    def live(self) -> list[ReplicaHandle]:
        """Replicas in the latest lookup that did not fail since."""
        return [h for rid in self.listed if (h := self.handles.get(rid)) is not None and h.alive]

    def known(self) -> list[ReplicaHandle]:
        """Every replica not marked dead, listed or not (the view when Redis is unreachable)."""
        return [h for h in self.handles.values() if h.alive]

    def tokenizer(self, group: GROUP_KEY) -> object | None:
        return self.tokenizers.get(group)

    # -- model info ---------------------------------------------------------------------------

    def _fetch_model_info(self, handle: ReplicaHandle) -> None:
        group = handle.lease.group
        if group in self._fetching:
            return
        self._fetching.add(group)
        self._spawn(self._load_tokenizer(handle, group))

    async def _load_tokenizer(self, handle: ReplicaHandle, group: GROUP_KEY) -> None:
        from prefixmesh.tokenizer import Tokenizer

        try:
            try:
                info: pb.ModelInfo = await handle.admin.GetModelInfo(
                    pb.Empty(), timeout=10.0, metadata=self.metadata
                )
            except grpc.aio.AioRpcError as exc:  # the next discovery round tries again
                if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                    self.key_refused(handle)
                elif self._first_report(handle, exc.code().name):
                    log.warning(
                        "GetModelInfo from %s failed: %s (asked again every discovery round; "
                        "logged once)", handle.replica_id, exc.code().name,
                    )  # fmt: skip
                return
            self._reported = {r for r in self._reported if r[0] != handle.replica_id}
            if info.hash_scheme and info.hash_scheme != HASH_SCHEME:
                log.error(
                    "replica %s hashes blocks with %s, this router with %s: routing to it "
                    "ignores its cache", handle.replica_id, info.hash_scheme, HASH_SCHEME,
                )  # fmt: skip
            else:
                self.model_ids[group] = info.model or group[0]
            tokenizer = None
            if info.tokenizer_json:
                try:
                    tokenizer = await asyncio.to_thread(
                        Tokenizer.from_bytes, info.tokenizer_json, info.tokenizer_config_json
                    )
                except Exception as exc:  # a broken file must not take the router down
                    log.error("tokenizer of %s unusable (%s): routing its text blind", group, exc)
            # None = no tokenizer: token-id requests are still hashed, text ones go least-loaded.
            self.tokenizers[group] = tokenizer
            log.info("model %s (block size %d) ready for routing", group[0], group[1])
        finally:
            self._fetching.discard(group)

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for handle in self.handles.values():
            await handle.channel.close()
        self.handles.clear()
