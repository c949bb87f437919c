"""Warm start: a replica that joins a cluster pre-fetches the cluster's hottest prefixes.

"Hottest" is read from the Redis map (``prefixmesh/redis_layout.py``), the one record of the
cluster's cache that exists without a router: the blocks held by the most live peers (a prefix
is duplicated because it is hot), ties in the map's order. The routers keep no per-prefix counts
in Redis. Redis holds hashes, not prompts, so the joiner cannot name a chain in order: it asks
the peer holding most of those blocks with ``FetchBlocksRequest.any_order``, and the peer
streams each one's whole chain, parents first, each block with its ``parent_hash``. The joiner
checks every block's tokens against its hash from its parent (the root of the empty
``cache_salt``, a block received before, or one it holds), so it never caches KV under a
wrong prompt; a tenant's salted blocks never chain from that root, so they are never sent.

It runs in the background after the replica serves (readiness never waits for it), at most
``share`` of the pool, once; any failure only means a colder start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import grpc
from redis.exceptions import RedisError

from prefixmesh import redis_layout
from prefixmesh.auth import bearer_metadata
from prefixmesh.hashing import BlockHash, hash_block, root_hash
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from replica.fetch.client import Holder, PeerFetcher

log = logging.getLogger(__name__)


async def hottest_blocks(fetcher: PeerFetcher, limit: int) -> tuple[Holder | None, list[bytes]]:
    """The ``limit`` blocks most live peers hold (not held here), and the peer holding most."""
    from replica.fetch.client import Holder

    holders = fetcher.holders
    if holders is None or limit <= 0:
        return None, []
    client, ns, layout = holders.client, holders.ns, holders.layout
    ids = [i.decode() for i in await client.smembers(redis_layout.replicas_key(ns))]
    peers = [i for i in ids if i != holders.replica_id]
    if not peers:
        return None, []
    async with client.pipeline(transaction=False) as pipe:
        for peer in peers:
            pipe.hmget(redis_layout.lease_key(peer, ns), "address", "model", "block_size")
            pipe.smembers(redis_layout.blocks_key(peer, ns))
        replies = await pipe.execute()
    held: dict[str, tuple[str, set[bytes]]] = {}
    counts: Counter[bytes] = Counter()
    for peer, lease, blocks in zip(peers, replies[::2], replies[1::2]):
        address, model, block_size = (v.decode() if v else "" for v in lease)
        if address and model == layout.model_id and block_size == str(layout.block_size):
            held[peer] = (address, blocks)
            counts.update(blocks)
    engine = fetcher.loop.engine
    hot = [h for h, _ in counts.most_common() if not engine.cached_prefix_blocks([h])][:limit]
    if not hot:
        return None, []
    peer, (address, blocks) = max(held.items(), key=lambda kv: len(blocks_in(kv[1][1], hot)))
    return Holder(peer, address, len(blocks_in(blocks, hot))), hot


def blocks_in(blocks: set[bytes], wanted: list[bytes]) -> list[bytes]:
    return [h for h in wanted if h in blocks]


async def warm_start(fetcher: PeerFetcher, num_blocks: int, share: float) -> int:
    """Pre-fetch up to ``share`` of a ``num_blocks`` pool; returns the blocks inserted."""
    limit = int(share * num_blocks)
    try:
        holder, hot = await hottest_blocks(fetcher, limit)
    except (RedisError, OSError) as exc:
        log.warning("warm start: reading the Redis map failed: %s", exc)
        return 0
    if holder is None:
        log.info("warm start: no peer holds blocks to pre-fetch")
        return 0
    started = time.monotonic()
    blocks, outcome = await pull_chains(fetcher, holder, hot)
    inserted = await fetcher.insert(blocks)
    seconds = time.monotonic() - started
    fetcher.count("warm_start", inserted * fetcher.layout.block_size,
                   len(blocks) * fetcher.bytes_per_block)  # fmt: skip
    log.info(
        "warm start: %d blocks from %s in %.3fs (%s; %d wanted)",
        inserted, holder.replica_id, seconds, outcome, len(hot),
    )  # fmt: skip
    return inserted


async def pull_chains(
    fetcher: PeerFetcher, holder: Holder, wanted: list[BlockHash]
) -> tuple[list[pb.KVBlock], str]:
    """The chains ``holder`` streams for ``wanted`` (any order), each block checked."""
    layout = fetcher.layout
    request = pb.FetchBlocksRequest(
        block_hashes=wanted, model=layout.model_id, dtype=layout.dtype,
        block_size=layout.block_size, hash_scheme=layout.hash_scheme, any_order=True,
    )  # fmt: skip
    stub = pb_grpc.ReplicaStub(fetcher.channel(holder.address))
    call = stub.FetchBlocks(
        request, timeout=fetcher.config.timeout_s, metadata=bearer_metadata(fetcher.api_key)
    )
    root = root_hash(layout.model_id, None)
    engine = fetcher.loop.engine
    accepted: set[bytes] = set()
    blocks: list[pb.KVBlock] = []
    try:
        async for block in call:
            parent = block.parent_hash or root
            known = parent == root or parent in accepted or engine.cached_prefix_blocks([parent])
            if not known or hash_block(parent, block.token_ids) != block.block_hash:
                call.cancel()
                log.warning("warm start: %s sent a block off its chain", holder.replica_id)
                return blocks, "failed"
            if parent == root:
                block.parent_hash = b""  # a prompt's first block
            accepted.add(block.block_hash)
            blocks.append(block)
            if len(blocks) >= len(wanted):
                break
    except grpc.aio.AioRpcError as exc:
        log.warning("warm start from %s: %s", holder.replica_id, exc.code().name)
        return blocks, "failed"
    except asyncio.CancelledError:
        call.cancel()
        raise
    return blocks, "fetched"
