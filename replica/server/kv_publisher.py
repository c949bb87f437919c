"""Keeps Redis' view of this replica exact: its lease, its load and its cached block hashes.

The layout is ``prefixmesh.redis_layout``'s. The engine thread reports stored/removed block
hashes into a ``KVEventBuffer`` (a list append under a lock, nothing more on its critical path);
one asyncio task, the ``KVPublisher``, flushes the buffer in one MULTI per wakeup, refreshes the
lease and load every ``LOAD_REFRESH_S`` and resynchronizes the whole block set when Redis'
copy can no longer be trusted:

- at start (a new epoch);
- after any Redis error (the connection dropped, a flush may have half-applied, Redis may have
  restarted empty); until the resync, buffered events are dropped, as the resync supersedes them;
- when a refresh finds the lease gone, ``blocks_epoch`` missing or different, or the set's size
  different from what was published (someone flushed, evicted or deleted keys).

Every change also goes to the KV event stream (``prefixmesh/kv_events.py``) in the same MULTI:
a delta per flush, a reset per resync, numbered per epoch. Routers mirror the block sets from it.

Ordering: a resync takes the engine's snapshot *on the engine thread* and clears the buffer in
the same breath (``KVEventBuffer.cut``). Events are only produced on that thread, so every event
before the cut is inside the snapshot and every event after it is in the buffer, applied after
the snapshot by the same task. Nothing is lost or reordered.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from prefixmesh import kv_events
from prefixmesh import redis_layout as layout

log = logging.getLogger(__name__)

BlockHash = bytes
# SADD arguments per command during a resync: large sets go in chunks inside one MULTI.
_SADD_CHUNK = 4096
_MAX_BACKOFF_S = 2.0


class KVEventBuffer:
    """Block stored/removed events from the engine thread, waiting for the publisher.

    ``append`` is the engine's KV event callback. While the publisher knows Redis is out of date
    (``invalidate``), events are dropped: the coming resync's snapshot supersedes them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[list[BlockHash], list[BlockHash]]] = []
        self._discarding = True  # nothing is worth keeping before the first resync
        self._notify: Callable[[], None] | None = None

    def set_notify(self, notify: Callable[[], None] | None) -> None:
        """``notify()`` is called (from the engine thread) when the buffer stops being empty."""
        self._notify = notify

    def append(self, stored: Iterable[BlockHash], removed: Iterable[BlockHash]) -> None:
        stored, removed = list(stored), list(removed)
        if not stored and not removed:
            return
        with self._lock:
            if self._discarding:
                return
            was_empty = not self._events
            self._events.append((stored, removed))
        if was_empty and self._notify is not None:
            self._notify()

    def drain(self) -> list[tuple[list[BlockHash], list[BlockHash]]]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def invalidate(self) -> None:
        """Redis is out of date: drop what is buffered and what comes until the next cut."""
        with self._lock:
            self._events = []
            self._discarding = True

    def cut(self, snapshot: Callable[[], Iterable[BlockHash]]) -> set[BlockHash]:
        """Take the full snapshot and restart buffering from exactly this point.

        Must run on the thread that produces events (the engine thread), so that no event falls
        between the snapshot and the restart.
        """
        with self._lock:
            self._events = []
            self._discarding = False
            return set(snapshot())

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)


def net_changes(
    events: list[tuple[list[BlockHash], list[BlockHash]]],
) -> tuple[set[BlockHash], set[BlockHash]]:
    """Collapse an ordered event list to (add, remove) sets: a hash's last event wins."""
    last: dict[BlockHash, bool] = {}
    for stored, removed in events:
        for h in stored:
            last[h] = True
        for h in removed:
            last[h] = False
    added = {h for h, present in last.items() if present}
    return added, set(last) - added


class KVPublisher:
    """Lease, load and block-set publisher of one replica (one asyncio task).

    ``snapshot`` must return the engine's cached hashes through ``KVEventBuffer.cut`` run on
    the engine thread; ``load`` returns the current load fields. Redis being down never raises
    out of here: the publisher logs, backs off, retries and resyncs when Redis is back.
    """

    def __init__(
        self,
        redis_url: str,
        replica_id: str,
        lease: Mapping[str, Any],
        load: Callable[[], Mapping[str, Any]],
        snapshot: Callable[[], Awaitable[set[BlockHash]]],
        buffer: KVEventBuffer,
        *,
        namespace: str = layout.DEFAULT_NAMESPACE,
        refresh_interval: float = layout.LOAD_REFRESH_S,
        coalesce_s: float = 0.002,
    ) -> None:
        self.replica_id = replica_id
        self.epoch = secrets.token_hex(8)
        self._lease_static = {k: str(v) for k, v in lease.items()}
        self._lease_static.update(epoch=self.epoch, started_at=f"{time.time():.3f}")
        self._load = load
        self._snapshot = snapshot
        self._buffer = buffer
        self._refresh_interval = refresh_interval
        self._coalesce_s = coalesce_s
        self._keys = _Keys(replica_id, namespace)
        self._ns = namespace
        self._seq = 0  # the last KV event's number (the lease's kv_seq)
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        self._published: set[BlockHash] = set()  # what Redis holds, as far as we know
        self._needs_resync = True
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.connected = False
        self.resyncs = 0
        self.flushes = 0
        self.errors = 0
        self.last_error = ""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._buffer.set_notify(lambda: loop.call_soon_threadsafe(self._wakeup.set))
        self._task = asyncio.create_task(self._run(), name=f"kv-publisher-{self.replica_id}")

    async def close(self, deregister: bool = True) -> None:
        """Stop publishing; with ``deregister``, remove the lease and block set from Redis."""
        self._closing = True
        self._buffer.set_notify(None)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if deregister:
            try:
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.delete(self._keys.lease, self._keys.blocks, self._keys.blocks_epoch)
                    pipe.srem(self._keys.replicas, self.replica_id)
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("could not deregister from Redis: %s", exc)
        await self._redis.aclose()

    @property
    def published_blocks(self) -> int:
        return len(self._published)

    # -- the task -------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.0
        next_refresh = 0.0
        while not self._closing:
            try:
                if self._needs_resync:
                    await self._resync()
                    next_refresh = time.monotonic() + self._refresh_interval
                if time.monotonic() >= next_refresh:
                    await self._refresh()
                    next_refresh = time.monotonic() + self._refresh_interval
                    if self._needs_resync:
                        continue
                await self._flush()
                if not self.connected:
                    again = "reachable again" if self.errors else "connected"
                    log.info("Redis %s: replica %s registered", again, self.replica_id)
                self.connected, backoff = True, 0.0
            except Exception as exc:  # Redis errors, timeouts, and anything unforeseen
                if not isinstance(exc, (RedisError, OSError, asyncio.TimeoutError)):
                    log.exception("unexpected error publishing to Redis")
                self._on_error(exc)
                backoff = min(max(0.1, backoff * 2), _MAX_BACKOFF_S)
                await asyncio.sleep(backoff)
                continue
            await self._wait(next_refresh - time.monotonic())

    async def _wait(self, timeout: float) -> None:
        if len(self._buffer) == 0:
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=max(0.0, timeout))
            except asyncio.TimeoutError:
                return
        # Let the rest of this engine step's events arrive so they go in one MULTI.
        await asyncio.sleep(self._coalesce_s)

    def _on_error(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.connected or self.errors == 1:
            log.warning(
                "Redis unavailable (%s); serving on, will resync when back", self.last_error
            )
        self.connected = False
        self._needs_resync = True
        self._buffer.invalidate()

    def _lease_fields(self) -> dict[str, str]:
        fields = dict(self._lease_static)
        fields.update({k: str(v) for k, v in self._load().items()})
        fields["updated_at"] = f"{time.time():.3f}"
        fields["kv_seq"] = str(self._seq)
        return fields

    def _queue_lease(self, pipe: Any) -> None:
        pipe.hset(self._keys.lease, mapping=self._lease_fields())
        pipe.pexpire(self._keys.lease, layout.LEASE_TTL_MS)
        pipe.sadd(self._keys.replicas, self.replica_id)

    async def _resync(self) -> None:
        self._wakeup.clear()
        snapshot = await self._snapshot()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.blocks)
            hashes = list(snapshot)
            for i in range(0, len(hashes), _SADD_CHUNK):
                pipe.sadd(self._keys.blocks, *hashes[i : i + _SADD_CHUNK])
            pipe.pexpire(self._keys.blocks, layout.BLOCKS_TTL_MS)
            pipe.set(self._keys.blocks_epoch, self.epoch, px=layout.BLOCKS_TTL_MS)
            self._queue_lease(pipe)
            self._seq += 1
            kv_events.queue_event(
                pipe, self._ns, self.replica_id, self.epoch, self._seq, reset=True
            )
            await pipe.execute()
        self._published = snapshot
        self._needs_resync = False
        self.resyncs += 1
        log.info("resynced %d cached blocks to Redis (epoch %s)", len(snapshot), self.epoch)

    async def _refresh(self) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(self._keys.lease)
            pipe.get(self._keys.blocks_epoch)
            pipe.scard(self._keys.blocks)
            self._queue_lease(pipe)
            pipe.pexpire(self._keys.blocks, layout.BLOCKS_TTL_MS)
            pipe.pexpire(self._keys.blocks_epoch, layout.BLOCKS_TTL_MS)
            lease_existed, epoch, size, *_ = await pipe.execute()
        reason = ""
        if not lease_existed:
            reason = "lease was gone"
        elif epoch is None or epoch.decode() != self.epoch:
            reason = f"blocks_epoch is {epoch!r}"
        elif size != len(self._published):
            reason = f"Redis holds {size} blocks, {len(self._published)} published"
        if reason:
            log.warning(
                "Redis view of replica %s is stale (%s): resyncing", self.replica_id, reason
            )
            self._needs_resync = True
            self._buffer.invalidate()

    async def _flush(self) -> None:
        self._wakeup.clear()
        events = self._buffer.drain()
        if not events:
            return
        added, removed = net_changes(events)
        async with self._redis.pipeline(transaction=True) as pipe:
            if removed:
                pipe.srem(self._keys.blocks, *removed)
            if added:
                pipe.sadd(self._keys.blocks, *added)
                # A set emptied by SREM is deleted; re-created by SADD it has no TTL yet.
                pipe.pexpire(self._keys.blocks, layout.BLOCKS_TTL_MS)
            self._seq += 1
            kv_events.queue_event(
                pipe, self._ns, self.replica_id, self.epoch, self._seq,
                added=added, removed=removed,
            )  # fmt: skip
            await pipe.execute()
        self._published -= removed
        self._published |= added
        self.flushes += 1


class _Keys:
    def __init__(self, replica_id: str, ns: str) -> None:
        self.replicas = layout.replicas_key(ns)
        self.lease = layout.lease_key(replica_id, ns)
        self.blocks = layout.blocks_key(replica_id, ns)
        self.blocks_epoch = layout.blocks_epoch_key(replica_id, ns)
