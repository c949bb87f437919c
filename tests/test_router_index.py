"""The router's Lua prefix lookup and shared keys, against a real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis
from helpers import start_redis
from redis.exceptions import RedisError

from prefixmesh import redis_layout as layout
from prefixmesh.hashing import block_hashes
from router.fastredis import PipelinedRedis
from router.index import HashGroup, PrefixIndex

NS = "t"
MODEL, BS = "tiny", 4


def write_replica(r: redis.Redis, rid: str, hashes: list[bytes], **load: object) -> None:
    lease = {
        "address": f"127.0.0.1:{1000 + len(rid)}",
        "model": MODEL,
        "block_size": BS,
        "hash_scheme": "xxh3-128-v1",
        "epoch": "e1",
        "updated_at": time.time(),
        **load,
    }
    r.sadd(layout.replicas_key(NS), rid)
    r.hset(layout.lease_key(rid, NS), mapping=lease)
    if hashes:
        r.sadd(layout.blocks_key(rid, NS), *hashes)


def run(coro):
    return asyncio.run(coro)


async def _lookup(url: str, groups, router_id: str = "r1", **kw):
    client = aioredis.Redis.from_url(url)
    try:
        index = PrefixIndex(client, NS, router_id, **kw)
        return await index.lookup(groups)
    finally:
        await client.aclose()


def test_lookup_counts_leading_blocks_and_forgets_dead_replicas(redis_server: str) -> None:
    r = redis.Redis.from_url(redis_server)
    hashes = block_hashes(list(range(40)), BS, MODEL)  # 10 blocks
    write_replica(r, "a", hashes[:6], queued_tokens=120, running=3, fetch_cost=0.0625,
                  num_blocks=100, free_blocks=40, cached_blocks=6)  # fmt: skip
    write_replica(r, "b", hashes[:2] + hashes[3:9])  # a hole after block 2: only 2 lead
    write_replica(r, "c", [])
    r.sadd(layout.replicas_key(NS), "dead")  # registered once, lease expired since
    r.sadd(layout.blocks_key("dead", NS), hashes[0])

    found = run(_lookup(redis_server, [HashGroup(MODEL, BS, hashes)]))
    by_id = {m.replica_id: m for m in found}
    assert set(by_id) == {"a", "b", "c"}
    assert (by_id["a"].cached_blocks, by_id["b"].cached_blocks, by_id["c"].cached_blocks) == (
        6, 2, 0,
    )  # fmt: skip
    assert by_id["a"].lease.queued_tokens == 120 and by_id["a"].lease.running == 3
    # What fetching a token costs "a" (its lease's fetch_cost); "b" publishes none: no fetch.
    assert by_id["a"].lease.fetch_cost == 0.0625 and by_id["b"].lease.fetch_cost < 0
    # Its pool: 40 blocks an allocation can take, of which 6 at most are cached ones, so at
    # least 34 hold nothing; "b" does not say.
    assert by_id["a"].lease.empty_blocks == 34 and by_id["b"].lease.empty_blocks is None
    assert by_id["a"].lease.model == MODEL and by_id["a"].lease.block_size == BS
    # The dead replica is gone from the registry and its block set deleted.
    assert not r.sismember(layout.replicas_key(NS), "dead")
    assert not r.exists(layout.blocks_key("dead", NS))
    # Another model's hashes never match this model's replicas.
    other = run(_lookup(redis_server, [HashGroup("other", BS, hashes)]))
    assert all(m.cached_blocks == 0 for m in other)


def test_predicted_entries_extend_the_match_and_expire(redis_server: str) -> None:
    r = redis.Redis.from_url(redis_server)
    hashes = block_hashes(list(range(40)), BS, MODEL)
    write_replica(r, "a", hashes[:2])

    async def scenario() -> tuple[int, int, int]:
        client = aioredis.Redis.from_url(redis_server)
        index = PrefixIndex(client, NS, "r1", predicted_ttl_ms=300)
        await index.record_predicted("a", hashes[:7])
        during = (await index.lookup([HashGroup(MODEL, BS, hashes)]))[0]
        await asyncio.sleep(0.4)
        after = (await index.lookup([HashGroup(MODEL, BS, hashes)]))[0]
        size = await client.zcard(f"{NS}:router:predicted:a")
        await client.aclose()
        return during.predicted_blocks, after.predicted_blocks, size

    during, after, size = run(scenario())
    assert during == 7
    assert after == 2  # only what the replica itself reported remains
    assert size == 0  # expired entries are cleaned up, not just ignored


def test_settling_shortens_recorded_predictions_and_nothing_else(redis_server: str) -> None:
    """Once a request is prefilled its predicted entries are cut to the settle time: only
    entries that exist, and never lengthened."""
    r = redis.Redis.from_url(redis_server)
    hashes = block_hashes(list(range(40)), BS, MODEL)
    write_replica(r, "a", hashes[:2])
    key = f"{NS}:router:predicted:a"

    async def scenario() -> tuple[int, int, float, float, object]:
        client = aioredis.Redis.from_url(redis_server)
        index = PrefixIndex(client, NS, "r1", predicted_ttl_ms=5000)
        await index.record_predicted("a", hashes[:7])
        await index.settle_predicted("a", hashes[4:6], 100)
        await index.settle_predicted("a", [hashes[9]], 100)  # never predicted: not added
        at = time.time() * 1000
        await index.settle_predicted("a", [hashes[5]], 60_000)  # longer: left as it was
        during = (await index.lookup([HashGroup(MODEL, BS, hashes)]))[0]
        await asyncio.sleep(0.25)
        after = (await index.lookup([HashGroup(MODEL, BS, hashes)]))[0]
        kept = await client.zscore(key, hashes[6])  # not settled: still the full TTL
        short = await client.zscore(key, hashes[5])
        absent = await client.zscore(key, hashes[9])
        await client.aclose()
        return during.predicted_blocks, after.predicted_blocks, kept - at, short, absent

    during, after, kept_ms, short, absent = run(scenario())
    assert during == 7
    assert after == 4  # the leading run stops at the first settled (and expired) entry
    assert kept_ms > 4000
    assert short is None  # expired and cleaned up by the lookup, not lengthened to 60 s
    assert absent is None


def test_inflight_tokens_are_shared_between_routers_and_vanish_with_a_router(
    redis_server: str,
) -> None:
    r = redis.Redis.from_url(redis_server)
    write_replica(r, "a", [])
    write_replica(r, "b", [])

    async def scenario() -> tuple[dict[str, int], dict[str, int]]:
        client = aioredis.Redis.from_url(redis_server)
        r1 = PrefixIndex(client, NS, "r1", inflight_ttl_ms=300)
        r2 = PrefixIndex(client, NS, "r2", inflight_ttl_ms=300)
        await r1.publish_inflight({"a": 100, "b": 5})
        await r2.publish_inflight({"a": 7})
        seen_by_r2 = {m.replica_id: m.other_inflight_tokens for m in await r2.lookup()}
        await asyncio.sleep(0.4)  # r1 stops refreshing: it died
        await r2.publish_inflight({"a": 7})
        index3 = PrefixIndex(client, NS, "r3")
        later = {m.replica_id: m.other_inflight_tokens for m in await index3.lookup()}
        await client.aclose()
        return seen_by_r2, later

    seen_by_r2, later = run(scenario())
    assert seen_by_r2 == {"a": 100, "b": 5}  # a router does not count its own tokens
    assert later == {"a": 7, "b": 0}
    assert r.smembers(f"{NS}:router:routers") == {b"r2"}


def test_lookup_survives_a_script_flush(redis_server: str) -> None:
    """After a Redis restart the script cache is empty (NOSCRIPT): the lookup reloads it."""
    r = redis.Redis.from_url(redis_server)
    hashes = block_hashes(list(range(8)), BS, MODEL)
    write_replica(r, "a", hashes)

    async def scenario() -> tuple[int, int]:
        client = aioredis.Redis.from_url(redis_server)
        index = PrefixIndex(client, NS, "r1")
        first = (await index.lookup([HashGroup(MODEL, BS, hashes)]))[0].cached_blocks
        await client.script_flush()
        second = (await index.lookup([HashGroup(MODEL, BS, hashes)]))[0].cached_blocks
        await client.aclose()
        return first, second

    assert run(scenario()) == (2, 2)


def test_long_prompts_are_matched_in_chunks(redis_server: str) -> None:
    """More hashes than one SMISMEMBER/ZMSCORE call takes (chunks of 512)."""
    r = redis.Redis.from_url(redis_server)
    hashes = block_hashes(list(range(4 * 1200)), BS, MODEL)  # 1200 blocks
    write_replica(r, "a", hashes[:1100])

    async def scenario() -> tuple[int, int]:
        client = aioredis.Redis.from_url(redis_server)
        index = PrefixIndex(client, NS, "r1")
        await index.record_predicted("a", hashes[1100:1150])
        match = (await index.lookup([HashGroup(MODEL, BS, hashes)]))[0]
        await client.aclose()
        return match.cached_blocks, match.predicted_blocks

    assert run(scenario()) == (1100, 1150)


def test_pipelined_connection_answers_like_redis_py_and_recovers() -> None:
    """The hot-path connection: same answers, many concurrent callers, NOSCRIPT, restarts."""
    handle = start_redis()
    try:
        r = redis.Redis.from_url(handle.url)
        hashes = block_hashes(list(range(40)), BS, MODEL)
        write_replica(r, "a", hashes[:3])
        write_replica(r, "b", hashes[:7])
        groups = [HashGroup(MODEL, BS, hashes)]

        async def scenario() -> None:
            client = aioredis.Redis.from_url(handle.url)
            fast = PipelinedRedis(handle.url)
            slow_index = PrefixIndex(client, NS, "r1")
            fast_index = PrefixIndex(client, NS, "r1", fast=fast)
            expected = sorted(await slow_index.lookup(groups), key=lambda m: m.replica_id)
            answers = await asyncio.gather(*(fast_index.lookup(groups) for _ in range(50)))
            for answer in answers:
                assert sorted(answer, key=lambda m: m.replica_id) == expected
            await client.script_flush()  # NOSCRIPT: loaded again on the fly
            assert len(await fast_index.lookup(groups)) == 2
            handle.restart()  # empty Redis; the connection notices and reconnects
            write_replica(redis.Redis.from_url(handle.url), "c", [])
            await asyncio.sleep(0.05)
            found = await fast_index.lookup(groups)
            assert [m.replica_id for m in found] == ["c"]
            handle.stop()
            with pytest.raises(RedisError):
                await fast_index.lookup(groups)
            await fast.close()
            await client.aclose()

        run(scenario())
    finally:
        handle.stop()
