"""The router's in-memory block map mirror (router/mirror.py) against a real Redis.

The mirror must equal the Redis block sets: after a replica's events (applied from the stream,
no re-read), after dropped events (a gap: re-read), after Redis is flushed or restarted
(re-read), and on two routers at once. ``Follower`` runs a mirror with the refresh timer a
router runs (``MirrorIndex.refresh``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import redis
import redis.asyncio as aioredis
from helpers import start_redis
from redis.exceptions import RedisError
from test_kv_publisher import NS, RID, Harness, h

from prefixmesh import kv_events
from prefixmesh import redis_layout as layout
from router.index import HashGroup, MirrorIndex, PrefixIndex
from router.mirror import BlockMirror, MirroredSet

MODEL, BS = "tiny", 16  # the Harness replica's lease


class Follower:
    """One router's mirror and its refresh timer."""

    def __init__(self, url: str, router_id: str) -> None:
        self.client = aioredis.Redis.from_url(url, socket_timeout=0.5)
        self.mirror = BlockMirror(url, NS, router_id)
        self.index = MirrorIndex(self.client, self.mirror, NS, router_id)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Follower:
        await self.index.start()
        self._task = asyncio.get_running_loop().create_task(self._refresh())
        return self

    async def _refresh(self) -> None:
        while True:
            with contextlib.suppress(RedisError, OSError):
                await self.index.refresh()
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.index.close()
        await self.client.aclose()


@contextlib.asynccontextmanager
async def followers(url: str, n: int = 1) -> AsyncIterator[list[Follower]]:
    started = [await Follower(url, f"router-{i}").start() for i in range(n)]
    try:
        yield started
    finally:
        for f in started:
            await f.close()


def redis_sets(url: str) -> dict[str, set[bytes]]:
    client = redis.Redis.from_url(url)
    try:
        ids = [rid.decode() for rid in client.smembers(layout.replicas_key(NS))]
        return {rid: set(client.smembers(layout.blocks_key(rid, NS))) for rid in ids}
    finally:
        client.close()


async def converged(url: str, mirror: BlockMirror, want: set[bytes] | None = None) -> None:
    """Wait until the mirror holds exactly Redis' sets (and Redis ``want`` for RID, if given)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            sets = await asyncio.to_thread(redis_sets, url)
        except redis.ConnectionError:
            sets = {}
        mine = {rid: mirror.blocks(rid) for rid in sets}
        if sets and mine == sets and (want is None or sets.get(RID) == want):
            return
        if time.monotonic() > deadline:
            diff = {r: (len(sets[r] - mine[r]), len(mine[r] - sets[r])) for r in sets}
            raise AssertionError(f"mirror differs from Redis (missing, extra): {diff}")
        await asyncio.sleep(0.02)


def test_mirror_follows_events_and_answers_like_the_redis_lookup(redis_server: str) -> None:
    hs = Harness(redis_server)

    async def scenario() -> None:
        hs.engine.change([h(i) for i in range(100)], [])
        async with followers(redis_server) as (f,):
            await converged(redis_server, f.mirror, hs.engine.state())
            before = (f.mirror.full_resyncs, f.mirror.replica_resyncs)
            for i in range(30):  # stores, removals and re-stores, one flush each
                hs.engine.change([h(100 + i), h(i)], [h(3 * i), h(100 + i // 2)])
                await asyncio.sleep(0.005)
            await converged(redis_server, f.mirror, hs.engine.state())
            # Every change came from the stream: no re-read, no gap.
            assert (f.mirror.full_resyncs, f.mirror.replica_resyncs) == before
            assert f.mirror.gaps == 0 and f.mirror.events > 0

            # A decision's counts are the Redis lookup's.
            blocks = sorted(hs.engine.state())
            groups = [HashGroup(MODEL, BS, [blocks[0], blocks[1], h(999), blocks[2]])]
            direct = PrefixIndex(f.client, NS, "direct")
            await f.index.refresh()
            assert (
                [(m.replica_id, m.cached_blocks) for m in await f.index.lookup(groups)]
                == [(m.replica_id, m.cached_blocks) for m in await direct.lookup(groups)]
                == [(RID, 2)]
            )

    try:
        asyncio.run(scenario())
    finally:
        hs.close()


class Writer:
    """A replica's side of the contract written by hand, so a test can drop events."""

    def __init__(self, url: str, rid: str = "w") -> None:
        self.client = redis.Redis.from_url(url)
        self.rid, self.seq, self.epoch = rid, 0, "e1"

    def register(self, blocks: set[bytes]) -> None:
        lease = {"address": "127.0.0.1:9", "model": MODEL, "block_size": BS, "epoch": self.epoch}
        with self.client.pipeline(transaction=True) as pipe:
            pipe.sadd(layout.replicas_key(NS), self.rid)
            pipe.hset(layout.lease_key(self.rid, NS), mapping=lease)
            pipe.delete(layout.blocks_key(self.rid, NS))
            pipe.sadd(layout.blocks_key(self.rid, NS), *blocks)
            pipe.set(layout.blocks_epoch_key(self.rid, NS), self.epoch)
            self.seq += 1
            kv_events.queue_event(pipe, NS, self.rid, self.epoch, self.seq, reset=True)
            pipe.execute()

    def change(self, added: list[bytes], removed: list[bytes], drop_event: bool = False) -> None:
        with self.client.pipeline(transaction=True) as pipe:
            if added:
                pipe.sadd(layout.blocks_key(self.rid, NS), *added)
            if removed:
                pipe.srem(layout.blocks_key(self.rid, NS), *removed)
            self.seq += 1
            if drop_event:  # the set and kv_seq move on, the event never reaches the stream
                pipe.hset(layout.lease_key(self.rid, NS), "kv_seq", self.seq)
            else:
                kv_events.queue_event(
                    pipe, NS, self.rid, self.epoch, self.seq, added=added, removed=removed
                )
            pipe.execute()


def test_dropped_events_are_found_and_the_set_reread(redis_server: str) -> None:
    w = Writer(redis_server)
    w.register({h(i) for i in range(10)})

    async def scenario() -> None:
        async with followers(redis_server) as (f,):
            await converged(redis_server, f.mirror)
            # A dropped event, then the next one: its number jumps.
            w.change([h(10)], [h(0)], drop_event=True)
            w.change([h(11)], [])
            await converged(redis_server, f.mirror)
            assert h(10) in f.mirror.blocks("w") and h(0) not in f.mirror.blocks("w")
            assert f.mirror.gaps == 1
            # The last event dropped, nothing after it: the refresh sees kv_seq ahead.
            w.change([h(12)], [h(1)], drop_event=True)
            await converged(redis_server, f.mirror)
            assert f.mirror.gaps == 2
            # Someone changed the set behind every replica's back: its size gives it away.
            w.client.srem(layout.blocks_key("w", NS), h(2))
            await converged(redis_server, f.mirror)
            assert f.mirror.gaps == 3
            # A trimmed stream loses events the same way as a dropped one.
            w.client.xtrim(layout.kv_events_key(NS), maxlen=0)
            w.change([h(13)], [], drop_event=True)
            w.change([h(14)], [])
            await converged(redis_server, f.mirror)
            assert h(13) in f.mirror.blocks("w")

    try:
        asyncio.run(scenario())
    finally:
        w.client.close()


def test_flushed_redis_is_reread_even_without_a_replica_event(redis_server: str) -> None:
    w = Writer(redis_server)
    w.register({h(i) for i in range(10)})

    async def scenario() -> None:
        async with followers(redis_server) as (f,):
            await converged(redis_server, f.mirror)
            full = f.mirror.full_resyncs
            w.client.flushall()
            # The replica writes its set again, and its reset event is lost.
            w.seq += 1
            with w.client.pipeline(transaction=True) as pipe:
                pipe.sadd(layout.replicas_key(NS), "w")
                pipe.hset(layout.lease_key("w", NS), mapping={"address": "x", "epoch": "e1"})
                pipe.hset(layout.lease_key("w", NS), "kv_seq", w.seq)
                pipe.sadd(layout.blocks_key("w", NS), h(20), h(21))
                pipe.set(layout.blocks_epoch_key("w", NS), "e1")
                pipe.execute()
            await converged(redis_server, f.mirror)
            assert f.mirror.blocks("w") == {h(20), h(21)}
            assert f.mirror.full_resyncs > full  # the router's marker key vanished

    try:
        asyncio.run(scenario())
    finally:
        w.client.close()


def test_redis_restart_and_replica_resync_reach_the_mirror() -> None:
    server = start_redis()
    hs = Harness(server.url)

    async def scenario() -> None:
        hs.engine.change([h(i) for i in range(50)], [])
        async with followers(server.url) as (f,):
            await converged(server.url, f.mirror, hs.engine.state())
            full = f.mirror.full_resyncs
            server.restart()  # empty: the replica re-registers and rewrites its set
            hs.engine.change([h(i) for i in range(50, 70)], [h(i) for i in range(10)])
            await converged(server.url, f.mirror, hs.engine.state())
            assert f.mirror.full_resyncs > full and f.mirror.ready
            # The replica's own resync (someone flushed its keys) reaches the mirror as a reset.
            client = redis.Redis.from_url(server.url)
            client.delete(layout.blocks_key(RID, NS))
            client.close()
            await converged(server.url, f.mirror, hs.engine.state())

    try:
        asyncio.run(scenario())
    finally:
        hs.close()
        server.stop()


async def lookup_until(index, group: list[HashGroup], predicted: int) -> list:
    """``index``'s lookup once it shows ``predicted`` blocks, or after 5 s. Empty while the
    router's listing of live replicas lags the lease (a loaded machine)."""
    deadline = time.monotonic() + 5
    while True:
        matches = await index.lookup(group)
        if matches and matches[0].predicted_blocks == predicted or time.monotonic() > deadline:
            return matches
        await asyncio.sleep(0.02)


def test_two_routers_agree_on_the_map_and_see_each_others_predictions(redis_server: str) -> None:
    hs = Harness(redis_server)

    async def scenario() -> None:
        async with followers(redis_server, n=2) as (a, b):
            for i in range(20):
                hs.engine.change([h(i), h(100 + i)], [h(i // 2)])
            await converged(redis_server, a.mirror, hs.engine.state())
            await converged(redis_server, b.mirror, hs.engine.state())
            # Router a routes a new prefix to the replica: b counts it as predicted at once.
            new = [h(500 + i) for i in range(4)]
            await a.index.record_predicted(RID, new)
            group = [HashGroup(MODEL, BS, new)]
            matches = await lookup_until(b.index, group, predicted=4)
            assert [(m.cached_blocks, m.predicted_blocks) for m in matches] == [(0, 4)]
            (own,) = await a.index.lookup(group)  # a keeps its own in the router's table
            assert own.predicted_blocks == 0
            # a's request is prefilled: a settles the entries, and b drops them soon after.
            await a.index.settle_predicted(RID, new, 50)
            matches = await lookup_until(b.index, group, predicted=0)
            assert [(m.cached_blocks, m.predicted_blocks) for m in matches] == [(0, 0)]
            # A prediction goes as soon as the replica announces its block: when the replica
            # evicts the block later, b's map no longer promises it (a stale hit).
            later = [h(600 + i) for i in range(4)]
            await a.index.record_predicted(RID, later)
            group = [HashGroup(MODEL, BS, later)]
            for _ in range(250):
                if b.mirror.predicted.get(RID, {}).get(later[3]):
                    break
                await asyncio.sleep(0.02)
            hs.engine.change(later[:2], [])
            await converged(redis_server, b.mirror, hs.engine.state())
            assert set(later[:2]).isdisjoint(b.mirror.predicted[RID])
            (m,) = await b.index.lookup(group)
            assert (m.cached_blocks, m.predicted_blocks) == (2, 4)
            hs.engine.change([], later[:2])  # evicted
            await converged(redis_server, b.mirror, hs.engine.state())
            (m,) = await b.index.lookup(group)
            assert (m.cached_blocks, m.predicted_blocks) == (0, 0)

    try:
        asyncio.run(scenario())
    finally:
        hs.close()


def test_leading_blocks_are_the_first_missing_hash_as_a_loop_finds_it() -> None:
    """``BlockMirror.leading`` counts the hashes before the first one its set lacks (and the
    predicted ones after them), as the plain loop does, on sets with holes and full hits."""
    import random

    rng = random.Random(3)
    mirror = BlockMirror("redis://127.0.0.1:1/0", NS, "router-a")
    for _ in range(2000):
        hashes = [rng.randbytes(16) for _ in range(rng.randrange(0, 40))]
        held = {x for x in hashes if rng.random() < 0.9} | {rng.randbytes(16)}
        if rng.random() < 0.3:
            held |= set(hashes)  # a full hit
        mirror.sets[RID] = MirroredSet(held, "e", 0, (0, 0))
        cached = 0
        while cached < len(hashes) and hashes[cached] in held:
            cached += 1
        predicted = cached
        if rng.random() < 0.5:
            ahead = hashes[cached : cached + rng.randrange(0, 5)]
            mirror.predicted[RID] = dict.fromkeys(ahead, time.monotonic() + 60)
            predicted += len(ahead)
        else:
            mirror.predicted.pop(RID, None)
        assert mirror.leading(RID, hashes) == (cached, predicted)
    assert mirror.leading("unknown", hashes) == (0, 0)
