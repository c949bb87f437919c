"""The router's in-memory mirror of the replicas' block sets: routing without a Redis round trip.

Redis stays the source of truth. The mirror follows the KV event stream
(``prefixmesh/kv_events.py``) on its own connection and re-reads sets from Redis whenever it
cannot trust what it holds:

- at start, after any Redis error (reconnect), and when the router-owned marker
  ``{ns}:router:map_epoch`` changes (Redis restarted or was flushed): every set, atomically with
  the stream's last id, from which the stream is then followed;
- for one replica, on a reset event (it rewrote its set), on a new epoch, or on a gap: its event
  numbers jump, or the periodic ``check`` finds the lease's ``kv_seq`` or the set's size differ
  from the mirror's once the mirror has read the stream up to where Redis is.

A re-read and the stream id it matches come from one Lua call, so events already in the re-read
copy are skipped and none after it are lost. Only the reader task applies events and re-reads,
so they never interleave. Every router on one Redis follows the same stream from the same sets,
so they agree on the map; predicted entries (router/index.py) travel on the stream too.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import takewhile

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from prefixmesh import redis_layout as layout
from prefixmesh.kv_events import PREDICTED, RESET, KVEvent, stream_id
from router.expiring import ExpiringEntries

log = logging.getLogger("prefixmesh.router")

# ARGV: ns, a fresh marker token, mode ('sets' or 'sizes'), then replica ids (none: every
# registered one). Returns {marker, stream's last id, rows}; a row is {id, blocks_epoch,
# kv_seq, members (sets) or size (sizes)}.
SNAPSHOT_LUA = """
local ns, mode = ARGV[1], ARGV[3]
local marker = ns .. ':router:map_epoch'
redis.call('SET', marker, ARGV[2], 'NX')
local ids = {}
if #ARGV > 3 then
  for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('SMEMBERS', ns .. ':replicas')
end
local last = redis.call('XREVRANGE', ns .. ':kv_events', '+', '-', 'COUNT', 1)
local rows = {}
for _, id in ipairs(ids) do
  local bkey = ns .. ':blocks:' .. id
  local blocks
  if mode == 'sets' then blocks = redis.call('SMEMBERS', bkey) else blocks = redis.call('SCARD', bkey) end
  rows[#rows + 1] = {
    id, redis.call('GET', ns .. ':blocks_epoch:' .. id) or '',
    redis.call('HGET', ns .. ':lease:' .. id, 'kv_seq') or '0', blocks,
  }
end
return {redis.call('GET', marker), last[1] and last[1][1] or '0-0', rows}
"""

_READ_COUNT = 1000
_MAX_BACKOFF_S = 1.0
_READ_TIMEOUT_S = 5.0


@dataclass(slots=True)
class MirroredSet:
    """One replica's block set as of stream id ``synced_at`` plus the events applied since."""

    blocks: set[bytes]
    epoch: str
    seq: int  # the last applied event's number
    synced_at: tuple[int, int]  # stream id of the last re-read: older events are inside it


class BlockMirror:
    """Block sets and other routers' predicted entries, kept in memory from the event stream."""

    def __init__(
        self,
        url: str,
        namespace: str,
        router_id: str,
        timeout_s: float = 0.5,
        block_ms: int = 100,
    ) -> None:
        self.ns = namespace
        self.router_id = router_id
        self.block_ms = block_ms
        # The reader's own connection: XREAD BLOCK holds it for up to block_ms. Its read
        # timeout is generous: a busy event loop must not pass for a dead Redis (a closed
        # connection shows at once, and the refresh timer's lookups time out after timeout_s).
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=block_ms / 1000 + max(timeout_s, _READ_TIMEOUT_S),
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._script = self._redis.register_script(SNAPSHOT_LUA)
        self._stream = layout.kv_events_key(namespace)
        self.sets: dict[str, MirroredSet] = {}
        # Other routers' predicted entries (router/expiring.py; ours are router/bookkeeping.py's).
        self.predicted = ExpiringEntries()
        # Called with (replica id, hashes) when a replica announces blocks it now holds, after
        # the set has them: the router drops its own predictions of them (router/routing.py).
        self.on_added: Callable[[str, Sequence[bytes]], None] | None = None
        self.cursor = b"0-0"  # the last stream id read
        self.marker: bytes | None = None
        self.ready = False  # in sync since the last full re-read (false while Redis is away)
        self._full = True
        self._dirty: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.events = 0
        self.full_resyncs = 0
        self.replica_resyncs = 0
        self.gaps = 0

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """First full read (if Redis answers), then follow the stream in the background."""
        try:
            await self._sync()
        except (RedisError, OSError) as exc:
            log.warning("block map mirror: first read failed (%s); retrying in background", exc)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="block-mirror")

    async def close(self) -> None:
        # The reader stops by itself within block_ms: cancelling redis-py in the middle of a
        # blocking XREAD can leave the task waiting on a reply forever.
        self._closing = True
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=self.block_ms / 1000 + 1.0)
            self._task.cancel()
        await self._redis.aclose()

    async def _run(self) -> None:
        backoff = 0.0
        while not self._closing:
            try:
                if self._full:
                    await self._sync()
                elif self._dirty:
                    await self._sync(sorted(self._dirty))
                reply = await self._redis.xread(
                    {self._stream: self.cursor}, count=_READ_COUNT, block=self.block_ms
                )
                for _stream, entries in reply:
                    for entry_id, fields in entries:
                        self._apply(entry_id, fields)
                backoff = 0.0
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                if self.ready:
                    log.warning("block map mirror lost Redis (%s): full re-read when back", exc)
                self.ready, self._full = False, True
                backoff = min(max(0.1, backoff * 2), _MAX_BACKOFF_S)
                await asyncio.sleep(backoff)

    # -- reading ------------------------------------------------------------------------------

    async def _snapshot(self, mode: str, ids: Sequence[str] = ()) -> tuple[bytes, bytes, list]:
        token = secrets.token_hex(8)
        marker, last, rows = await self._script(keys=[], args=[self.ns, token, mode, *ids])
        return marker, last, rows

    async def _sync(self, ids: Sequence[str] | None = None) -> None:
        """Re-read ``ids``' sets (all registered replicas if None) and where the stream is."""
        marker, last, rows = await self._snapshot("sets", ids or ())
        at = stream_id(last)
        fresh = {
            _text(rid): MirroredSet(set(members), _text(epoch), int(seq), at)
            for rid, epoch, seq, members in rows
        }
        if ids is None:
            self.sets, self.cursor, self.marker = fresh, last, marker
            self._dirty.clear()
            self.full_resyncs += 1
            self._full, self.ready = False, True
            log.info("block map mirror: %d replicas read from Redis", len(fresh))
        else:
            self.sets.update(fresh)
            self._dirty.difference_update(ids)
            self.replica_resyncs += len(ids)

    def _apply(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        self.cursor = entry_id
        self.events += 1
        event = KVEvent.parse(fields)
        rid = event.replica_id
        if event.kind == PREDICTED:
            if event.router_id != self.router_id:  # our own are in the router's local table
                self.predicted.put(rid, event.added, time.monotonic() + event.ttl_ms / 1000)
            return
        mirrored = self.sets.get(rid)
        if mirrored is None or rid in self._dirty:
            self._dirty.add(rid)  # a new replica, or a re-read already due
            return
        if stream_id(entry_id) <= mirrored.synced_at:
            return  # inside the last re-read
        if event.kind == RESET or event.epoch != mirrored.epoch or event.seq != mirrored.seq + 1:
            if event.kind != RESET and event.epoch == mirrored.epoch:
                self.gaps += 1
                log.info("block map mirror: replica %s event %d after %d: re-reading its set",
                         rid, event.seq, mirrored.seq)  # fmt: skip
            self._dirty.add(rid)
            return
        mirrored.blocks.difference_update(event.removed)
        mirrored.blocks.update(event.added)
        mirrored.seq = event.seq
        if event.added:
            # Held now: from here on the set says whether the replica still holds them, so a
            # prediction of them would only outlive an eviction (a stale promise).
            self.predicted.drop(rid, event.added)
            if self.on_added is not None:
                self.on_added(rid, event.added)

    # -- the periodic check -------------------------------------------------------------------

    async def check(self, script: AsyncScript) -> None:
        """Compare with Redis (``script``: SNAPSHOT_LUA on another connection than the
        reader's): mark replicas whose copy is behind or different, forget unregistered ones,
        drop expired predictions."""
        token = secrets.token_hex(8)
        marker, last, rows = await script(keys=[], args=[self.ns, token, "sizes"])
        self.predicted.prune()
        if not self.ready:
            return
        if marker != self.marker:
            log.warning("block map mirror: Redis was restarted or flushed: full re-read")
            self._full = True
            return
        here, there = stream_id(self.cursor), stream_id(last)
        listed = set()
        for rid, epoch, seq, size in rows:
            rid, seq = _text(rid), int(seq)
            listed.add(rid)
            mirrored = self.sets.get(rid)
            if rid in self._dirty:
                continue
            if mirrored is None or mirrored.epoch != _text(epoch):
                self._dirty.add(rid)
            elif (here >= there and mirrored.seq < seq) or (
                here == there and (mirrored.seq != seq or len(mirrored.blocks) != int(size))
            ):
                self.gaps += 1
                log.info("block map mirror: replica %s differs from Redis: re-reading", rid)
                self._dirty.add(rid)
        for rid in set(self.sets) - listed:
            del self.sets[rid]
        for rid in set(self.predicted) - listed:
            del self.predicted[rid]

    # -- queries ------------------------------------------------------------------------------

    def leading(self, replica_id: str, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(cached, predicted): leading blocks the replica holds, and holds or will hold."""
        mirrored = self.sets.get(replica_id)
        cached = 0
        if mirrored is not None:
            blocks = mirrored.blocks
            # A full hit (the usual answer of the replica holding a prompt's prefix) in one
            # C-level pass without a call per hash; otherwise up to the first hash not in the
            # set, in one C-level scan that stops there (a Python loop took twice as long on
            # a partial hit of a long prompt).
            if blocks.issuperset(hashes):
                cached = len(hashes)
            else:
                cached = len(list(takewhile(blocks.__contains__, hashes)))
        return cached, self.predicted.leading(replica_id, hashes, cached)

    def blocks(self, replica_id: str) -> set[bytes]:
        mirrored = self.sets.get(replica_id)
        return set(mirrored.blocks) if mirrored is not None else set()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
