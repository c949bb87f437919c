"""The Redis side of routing: the map lookup, plus the router-owned keys.

Two map sources (``--map-source``): ``redis``, one Lua round trip per request
(``PrefixIndex``), and ``mirror``, a local lookup in an in-memory copy of the block sets kept
from the KV event stream (``MirrorIndex``, router/mirror.py), with leases, load and other routers'
in-flight tokens read on a timer.

Replica-owned keys are described in ``prefixmesh/redis_layout.py``. Router-owned keys:

- ``{ns}:router:predicted:{replica_id}`` ZSET, member = raw 16-byte block hash, score = expiry
  (unix ms). Written when a request is routed (the blocks the chosen replica is about to
  compute), so a burst sharing a new prefix lands together on every router before the
  replica's KV events arrive. Expired members are removed by the lookup script; the key itself
  has a PEXPIRE of the TTL, so memory is bounded by the routing rate x TTL.
- ``{ns}:router:inflight:{router_id}`` HASH, field = replica id, value = tokens this router
  has sent there and not seen finish. Rewritten every ``inflight_flush_s`` with a PEXPIRE of
  ``inflight_ttl_ms``: a dead router's counts vanish with the key.
- ``{ns}:router:routers`` SET of router ids that published in-flight tokens; the lookup script
  drops ids whose in-flight hash is gone.

The script touches keys it derives from its arguments, so it needs a standalone Redis (or one
hash slot), not Redis Cluster.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from prefixmesh import kv_events
from prefixmesh.hashing import BlockHash
from router.discovery import Lease
from router.fastredis import PipelinedRedis
from router.mirror import SNAPSHOT_LUA, BlockMirror

# Lease fields the router reads, in the order the script returns them (HMGET: only what the
# router needs crosses the wire on every request).
LEASE_FIELDS = (
    "address", "http_address", "model", "block_size", "hash_scheme", "epoch", "running",
    "waiting", "kv_usage", "queued_tokens", "num_blocks", "updated_at", "cached_blocks",
    "fetch_cost", "free_blocks",
)  # fmt: skip

# ARGV: ns, now_ms, router_id, ngroups, then per group: model, block_size, and the group's
# 16-byte hashes concatenated into one string (one argument: packing dozens of arguments per
# request costs more on the client than splitting the string costs in Lua).
# Returns, per live replica: {id, cached_blocks, predicted_blocks, other_routers_inflight,
# lease values in LEASE_FIELDS order}. Replicas whose lease is gone are forgotten on the way.
LOOKUP_LUA = """
local FIELDS = {FIELDS}
local HASH_LEN = 16
-- How many of hashes[from + 1 ..] are present in a row (SMISMEMBER answers 1/0, ZMSCORE a
-- score or nil), asking in chunks so that unpack() stays within Lua's stack.
local function leading(cmd, key, hashes, from)
  local n = from
  while n < #hashes do
    local last = math.min(#hashes, n + 512)
    local found = redis.call(cmd, key, unpack(hashes, n + 1, last))
    for i = 1, #found do
      if not found[i] or found[i] == 0 then return n + i - 1 end
    end
    n = last
  end
  return n
end
local ns, now, me = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local groups, pos = {}, 5
for g = 1, tonumber(ARGV[4]) do
  local blob, hashes = ARGV[pos + 2], {}
  for i = 1, #blob, HASH_LEN do
    hashes[#hashes + 1] = string.sub(blob, i, i + HASH_LEN - 1)
  end
  groups[ARGV[pos] .. '\\0' .. ARGV[pos + 1]] = hashes
  pos = pos + 3
end
local routers_key = ns .. ':router:routers'
local others = {}
for _, r in ipairs(redis.call('SMEMBERS', routers_key)) do
  if r ~= me then
    if redis.call('EXISTS', ns .. ':router:inflight:' .. r) == 1 then
      table.insert(others, ns .. ':router:inflight:' .. r)
    else
      redis.call('SREM', routers_key, r)
    end
  end
end
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', ns .. ':replicas')) do
  local lkey = ns .. ':lease:' .. id
  local lease = redis.call('HMGET', lkey, unpack(FIELDS))
  local pkey = ns .. ':router:predicted:' .. id
  if not lease[1] and redis.call('EXISTS', lkey) == 0 then
    redis.call('SREM', ns .. ':replicas', id)
    redis.call('DEL', ns .. ':blocks:' .. id, ns .. ':blocks_epoch:' .. id, pkey)
  else
    local has_predicted = redis.call('EXISTS', pkey) == 1
    if has_predicted then redis.call('ZREMRANGEBYSCORE', pkey, '-inf', now) end
    local cached, predicted = 0, 0
    local grp = groups[(lease[3] or '') .. '\\0' .. (lease[4] or '')]
    if grp then
      cached = leading('SMISMEMBER', ns .. ':blocks:' .. id, grp, 0)
      predicted = cached
      if cached < #grp and has_predicted then
        predicted = leading('ZMSCORE', pkey, grp, cached)
      end
    end
    local inflight = 0
    for _, key in ipairs(others) do
      inflight = inflight + (tonumber(redis.call('HGET', key, id)) or 0)
    end
    table.insert(out, {id, cached, predicted, inflight, lease})
  end
end
return out
""".replace("{FIELDS}", "{" + ", ".join(f"'{f}'" for f in LEASE_FIELDS) + "}")


class HashGroup(NamedTuple):
    """The block hashes of one request for replicas of one (model, block_size)."""

    model: str
    block_size: int
    hashes: Sequence[BlockHash]


class ReplicaMatch(NamedTuple):
    """One live replica in a lookup answer."""

    replica_id: str
    cached_blocks: int
    predicted_blocks: int
    other_inflight_tokens: int
    lease: Lease


class PrefixIndex:
    """Lookup of cached prefixes and the router's shared state, all in Redis."""

    def __init__(
        self,
        client: aioredis.Redis,
        namespace: str,
        router_id: str,
        predicted_ttl_ms: int = 5000,
        inflight_ttl_ms: int = 3000,
        fast: PipelinedRedis | None = None,
    ) -> None:
        self.client = client
        self.fast = fast  # the lookup's own pipelined connection (router/fastredis.py)
        self.ns = namespace
        self.router_id = router_id
        self.predicted_ttl_ms = predicted_ttl_ms
        self.inflight_ttl_ms = inflight_ttl_ms
        # register_script runs EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
        # loads the script and retries once.
        self._lookup = client.register_script(LOOKUP_LUA)
        self._leases: dict[bytes, tuple[tuple[bytes | None, ...], Lease]] = {}

    def _key(self, *parts: str) -> str:
        return ":".join((self.ns, "router", *parts))

    async def start(self) -> None:
        """Nothing to prepare: every lookup asks Redis."""

    async def close(self) -> None:
        """Nothing to stop."""

    async def refresh(self) -> list[ReplicaMatch]:
        """Every live replica with its lease and other routers' in-flight tokens."""
        return await self.lookup()

    async def lookup(self, groups: Sequence[HashGroup] = ()) -> list[ReplicaMatch]:
        """Every live replica with the leading blocks it holds or will hold (one round trip)."""
        args: list[str | bytes | int] = [self.ns, int(time.time() * 1000), self.router_id]
        args.append(len(groups))
        for group in groups:
            args += [group.model, group.block_size, b"".join(group.hashes)]
        if self.fast is not None:
            rows = await self.fast.evalsha(self._lookup.sha, LOOKUP_LUA, args)
        else:
            rows = await self._lookup(keys=[], args=args)
        return [
            ReplicaMatch(
                replica_id=_text(row[0]),
                cached_blocks=int(row[1]),
                predicted_blocks=int(row[2]),
                other_inflight_tokens=int(row[3]),
                lease=self._lease(row[0], row[4]),
            )
            for row in rows
        ]

    def _lease(self, replica_id: bytes, values: list[bytes | None]) -> Lease:
        """Parse a lease, reusing the last one when nothing changed (most requests)."""
        raw = tuple(values)
        cached = self._leases.get(replica_id)
        if cached is not None and cached[0] == raw:
            return cached[1]
        lease = Lease.from_fields({k: _text(v) for k, v in zip(LEASE_FIELDS, raw) if v is not None})
        self._leases[replica_id] = (raw, lease)
        if len(self._leases) > 4096:  # replicas come and go: keep the cache bounded
            self._leases.clear()
        return lease

    async def record_predicted(self, replica_id: str, hashes: Sequence[BlockHash]) -> None:
        """Mark ``hashes`` as soon-to-be cached on ``replica_id`` for the predicted TTL."""
        if not hashes:
            return
        expiry = int(time.time() * 1000) + self.predicted_ttl_ms
        key = self._key("predicted", replica_id)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(key, dict.fromkeys(hashes, expiry))
            pipe.pexpire(key, self.predicted_ttl_ms)
            # Routers that mirror the map learn them from the event stream.
            kv_events.queue_predicted(
                pipe, self.ns, self.router_id, replica_id, hashes, self.predicted_ttl_ms
            )
            await pipe.execute()

    async def settle_predicted(
        self, replica_id: str, hashes: Sequence[BlockHash], ttl_ms: int
    ) -> None:
        """Shorten the predicted entries of ``hashes`` on ``replica_id`` to ``ttl_ms`` from now
        (the replica has computed them: its KV events take over). Entries already shorter, or
        gone, are left alone."""
        if not hashes:
            return
        expiry = int(time.time() * 1000) + ttl_ms
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(self._key("predicted", replica_id), dict.fromkeys(hashes, expiry),
                      xx=True, lt=True)  # fmt: skip
            kv_events.queue_predicted(pipe, self.ns, self.router_id, replica_id, hashes, ttl_ms)
            await pipe.execute()

    async def publish_inflight(self, tokens_by_replica: Mapping[str, int]) -> None:
        """Replace this router's in-flight token counts (atomically) and refresh their TTL."""
        key = self._key("inflight", self.router_id)
        mapping = {"_router": 0, **{rid: int(t) for rid, t in tokens_by_replica.items()}}
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.sadd(self._key("routers"), self.router_id)
            pipe.delete(key)
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, self.inflight_ttl_ms)
            await pipe.execute()

    async def retract(self) -> None:
        """Remove this router's in-flight counts (clean shutdown)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.srem(self._key("routers"), self.router_id)
            pipe.delete(self._key("inflight", self.router_id))
            await pipe.execute()


class MirrorNotReady(RedisError):
    """The mirror is not in sync with Redis (Redis unreachable, or a full re-read pending)."""


class MirrorIndex(PrefixIndex):
    """Lookups answered from the in-memory mirror: no network round trip per request.

    ``refresh`` (the router's timer) reads leases, load and in-flight tokens with the Redis
    lookup and checks the mirror against Redis; ``lookup`` combines the last refresh with the
    mirrored block sets and predicted entries. Writes are those of ``PrefixIndex``.
    """

    def __init__(self, client: aioredis.Redis, mirror: BlockMirror, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(client, *args, **kwargs)
        self.mirror = mirror
        self._check = client.register_script(SNAPSHOT_LUA)
        self._listed: list[ReplicaMatch] = []

    async def start(self) -> None:
        await self.mirror.start()

    async def close(self) -> None:
        await self.mirror.close()

    async def refresh(self) -> list[ReplicaMatch]:
        listed = await super().lookup()
        await self.mirror.check(self._check)
        self._listed = listed
        if not self.mirror.ready:  # Redis answers, the mirror's reader has not caught up yet
            raise MirrorNotReady("the block map mirror is not in sync with Redis yet")
        return listed

    async def lookup(self, groups: Sequence[HashGroup] = ()) -> list[ReplicaMatch]:
        if not self.mirror.ready:
            raise MirrorNotReady("the block map mirror is not in sync with Redis")
        by_group = {(g.model, g.block_size): g.hashes for g in groups}
        out = []
        for m in self._listed:
            hashes = by_group.get(m.lease.group)
            if hashes:
                cached, predicted = self.mirror.leading(m.replica_id, hashes)
                m = ReplicaMatch(m.replica_id, cached, predicted, m.other_inflight_tokens, m.lease)
            out.append(m)
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
