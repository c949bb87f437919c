"""Miss attribution (router/attribution.py): each kind of miss pinned by hand, then on a small
crafted workload through a real router, real Redis and echo replicas."""

from __future__ import annotations

import asyncio

import pytest
from test_router_server import cluster

from prefixmesh import redis_layout as layout
from proto import prefixmesh_pb2 as pb
from router.attribution import MissAttribution, PendingMisses


def test_split_assigns_each_block_position_one_fate() -> None:
    # 10 cacheable blocks; the map promised 6 on the chosen replica, another held 8, 9 were
    # seen before. The replica served 4 blocks (16 tokens of 4-token blocks).
    p = PendingMisses(4, 10, promised_blocks=6, elsewhere_blocks=8, seen_blocks=9)
    assert p.split(16) == {"hit": 4, "stale": 2, "elsewhere": 2, "evicted": 1, "compulsory": 1}
    # a replica that serves more than the map promised (late KV events) leaves fewer misses
    assert p.split(34) == {"hit": 9, "stale": 0, "elsewhere": 0, "evicted": 0, "compulsory": 1}
    # a partial block of cached tokens counts as that block served (prompt - 1 cap)
    assert p.split(39)["hit"] == 10
    fresh = PendingMisses(4, 5, 0, 0, 0)
    assert fresh.split(0) == {"hit": 0, "stale": 0, "elsewhere": 0, "evicted": 0, "compulsory": 5}


def test_seen_memory_is_bounded_and_windows_reset() -> None:
    a = MissAttribution(max_seen=3)
    first = a.pending([b"1", b"2"], prompt_tokens=9, block_size=4, promised_blocks=0,
                      elsewhere_blocks=0)  # fmt: skip
    assert first is not None and first.seen_blocks == 0 and first.cacheable_blocks == 2
    again = a.pending([b"1", b"2"], 9, 4, 0, 0)
    assert again is not None and again.seen_blocks == 2
    a.pending([b"3", b"4"], 9, 4, 0, 0)  # the oldest hash (b"1") is forgotten
    assert a.seen_prefix([b"1", b"2"]) == 0 and a.seen_prefix([b"3", b"4"]) == 2
    assert a.pending([b"1"], 0, 4, 0, 0) is None  # not tokenized: nothing to attribute
    a.settle(again, 0)
    assert a.snapshot()["evicted"] == 2 and a.snapshot()["cacheable"] == 2
    a.reset()
    assert a.snapshot()["cacheable"] == 0


def _misses(state: pb.ClusterState) -> dict[str, int]:
    return {k: v for k, v in state.routing.misses.items() if v}


def test_each_miss_kind_on_a_crafted_workload(redis_server: str) -> None:
    """Four prompts of 8 blocks (4 tokens each) plus one token, through a 3-replica cluster."""

    async def scenario() -> None:
        async with cluster(redis_server) as c:
            prefix = [2000 + i for i in range(32)]
            ns = layout.DEFAULT_NAMESPACE

            async def send(tail: int) -> tuple[str, int]:
                final = (await c.generate(prefix + [tail]))[-1]
                return final.replica_id, final.usage.cached_tokens

            async def delta(before: dict[str, int]) -> dict[str, int]:
                after = dict((await c.cluster.ListReplicas(pb.Empty())).routing.misses)
                return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}

            # compulsory: never seen
            first, _ = await send(1)
            state = await c.cluster.ListReplicas(pb.Empty())
            assert _misses(state) == {"compulsory": 8, "cacheable": 8}
            warm = c.by_address()[first]

            # hit: the same prefix again goes to the warm replica
            before = dict(state.routing.misses)
            assert await send(2) == (first, 32)
            assert await delta(before) == {"hit": 8, "cacheable": 8}

            # stale: the replica loses its blocks but Redis still lists them
            before = dict((await c.cluster.ListReplicas(pb.Empty())).routing.misses)
            warm.cached.clear()
            assert await send(3) == (first, 0)
            assert await delta(before) == {"stale": 8, "cacheable": 8}

            # evicted: no replica holds the prefix any more (block sets emptied), but it was
            # routed before
            for r in c.replicas:
                r.cached.clear()
                await c.router.router.redis.delete(layout.blocks_key(r.replica_id, ns))
            c.router.router.book.predicted.clear()  # this router's own recent predictions
            mirror = c.router.router.mirror  # its copy of the map notices within a refresh
            for _ in range(100):
                if mirror is None or not any(mirror.blocks(r.replica_id) for r in c.replicas):
                    break
                await asyncio.sleep(0.02)
            await c.router.router.redis.delete(
                *[f"{ns}:router:predicted:{r.replica_id}" for r in c.replicas]
            )
            before = dict((await c.cluster.ListReplicas(pb.Empty())).routing.misses)
            holder, cached = await send(4)
            assert cached == 0
            assert await delta(before) == {"evicted": 8, "cacheable": 8}

            # elsewhere: round robin sends the next request away from the one replica that
            # holds the prefix
            await c.cluster.SetPolicy(pb.SetPolicyRequest(policy="round_robin"))
            await asyncio.sleep(0.3)  # let the holder's KV refresh reach Redis
            before = dict((await c.cluster.ListReplicas(pb.Empty())).routing.misses)
            kinds: dict[str, int] = {}
            for tail in range(5, 8):  # three replicas in turn: two land away from the holder
                await send(tail)
            kinds = await delta(before)
            assert kinds.get("elsewhere", 0) >= 8, kinds
            assert kinds["cacheable"] == 24
            assert kinds.get("compulsory", 0) == kinds.get("evicted", 0) == 0, kinds

            # the same counts, cumulative, as a Prometheus counter
            reg = c.router.metrics.registry
            total = dict((await c.cluster.ListReplicas(pb.Empty())).routing.misses)
            for kind in ("compulsory", "evicted", "elsewhere", "stale", "hit"):
                value = reg.get_sample_value("router_prompt_blocks_total", {"kind": kind})
                assert value == total.get(kind, 0), kind

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["compulsory", "evicted", "elsewhere", "stale"])
def test_loadtest_report_prints_each_kind(kind: str) -> None:
    from loadtest.report import misses_line

    line = misses_line({kind: 3, "hit": 1, "cacheable": 4})
    assert f"{kind} 3 (75.0%)" in line and "hit 1 (25.0%)" in line


def test_a_prefilled_requests_predictions_do_not_outlive_its_blocks(redis_server: str) -> None:
    """The router predicts a new prefix's blocks on the replica it sends it to. Once the replica
    has answered, its own KV events are the truth: if it then evicts the blocks, the next
    request with that prefix counts them as evicted, not as a stale promise (which a
    prediction living its whole TTL, 5 s by default, made of them)."""

    async def scenario() -> None:
        async with cluster(redis_server) as c:
            ns = layout.DEFAULT_NAMESPACE
            prefix = [3000 + i for i in range(32)]
            first = (await c.generate(prefix + [1]))[-1]
            holder = c.by_address()[first.replica_id]
            rid = holder.replica_id
            settle = c.router.router.config.predicted_settle_ms / 1000
            assert settle <= 1
            # The replica evicts the prefix (its set in Redis emptied; the mirror re-reads it).
            holder.cached.clear()
            await c.router.router.redis.delete(layout.blocks_key(rid, ns))
            mirror = c.router.router.mirror
            for _ in range(100):
                if mirror is None or not mirror.blocks(rid):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(settle + 0.3)  # the settle time, and a flush to Redis
            before = dict((await c.cluster.ListReplicas(pb.Empty())).routing.misses)
            again = (await c.generate(prefix + [2]))[-1]
            assert again.usage.cached_tokens == 0
            after = dict((await c.cluster.ListReplicas(pb.Empty())).routing.misses)
            delta = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
            assert delta == {"evicted": 8, "cacheable": 8}

    asyncio.run(scenario())
