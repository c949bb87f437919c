"""Fetch-on-miss: before a request enters the engine, pull the leading KV blocks of its prompt
from a peer replica that holds more of them, when that is cheaper than prefilling them.

Where the blocks are: a router's ``fetch_hint`` in the request, else the Redis map (each live
replica's block set, ``prefixmesh/redis_layout.py``). The choice is a cost model (``FetchCost``):
fetching ``b`` blocks costs ``latency + b x bytes_per_block / bytes_per_s``, recomputing them
``b x block_size / prefill_tokens_per_s``; both rates start from configured guesses and follow
what this replica measures (each transfer, and each prefill's first token). Everything runs on
the event loop before ``EngineLoop.submit``: the engine thread only copies the received blocks
into its pool (``LLMEngine.import_blocks``). Any failure or a transfer past its deadline keeps
the blocks that did arrive (each checked against the prompt's hash chain) and prefills the
rest: the request itself never fails because of a fetch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from prefixmesh import redis_layout
from prefixmesh.auth import bearer_metadata
from prefixmesh.hashing import BlockHash, hash_block, root_hash
from prefixmesh.tls import TlsFiles, aio_channel
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from replica.fetch.transfer import FetchedBlocks, layer_tensor

if TYPE_CHECKING:
    import torch

    from replica.engine_request import EngineRequest
    from replica.fetch.layout import KVLayout
    from replica.server.engine_loop import EngineLoop
    from replica.server.metrics import ReplicaMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """The knobs of fetch-on-miss (``--fetch-*`` flags of ``prefixmesh replica``)."""

    timeout_s: float = 10.0  # the longest a transfer may take before recompute takes over
    min_blocks: int = 1  # fetch only when a peer holds at least this many more blocks
    bytes_per_s: float = 200e6  # starting guesses, replaced by measurements
    prefill_tokens_per_s: float = 1000.0
    latency_s: float = 0.005  # per transfer: one round trip and the holder's pin


class FetchCost:
    """Transfer and prefill speeds, as exponentially weighted averages of measurements."""

    MIN_BYTES_PER_S = 1.0  # a floor, so that costs stay finite after many timed-out fetches

    def __init__(self, config: FetchConfig, weight: float = 0.3) -> None:
        self.bytes_per_s = config.bytes_per_s
        self.prefill_tokens_per_s = config.prefill_tokens_per_s
        self.latency_s = config.latency_s
        self.weight = weight

    def fetch_s(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def worth_it(self, num_bytes: int, num_tokens: int) -> bool:
        return self.fetch_s(num_bytes) < self.recompute_s(num_tokens)

    def token_cost(self, bytes_per_token: float) -> float:
        """Seconds to fetch one prompt token's KV over seconds to prefill it, as measured so
        far (the per-transfer latency left out: it is paid once per prefix). Published in the
        lease, so routers price a prefix held by a peer at what fetching it costs here."""
        return bytes_per_token / self.bytes_per_s * self.prefill_tokens_per_s

    def record_transfer(self, num_bytes: int, seconds: float) -> None:
        """A transfer that moved ``num_bytes`` in ``seconds``. One that timed out counts too,
        with the bytes that did arrive (maybe none): a peer too busy to answer in time (its
        engine thread in a long prefill step) makes fetching cost more here, and routers see it
        in the lease's fetch cost."""
        if seconds > 0:
            w = self.weight
            rate = max(num_bytes / seconds, self.MIN_BYTES_PER_S)
            self.bytes_per_s = (1 - w) * self.bytes_per_s + w * rate

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            w = self.weight
            rate = num_tokens / seconds
            self.prefill_tokens_per_s = (1 - w) * self.prefill_tokens_per_s + w * rate


@dataclass(frozen=True, slots=True)
class Holder:
    """A peer replica and how many leading blocks of a prompt it holds."""

    replica_id: str
    address: str
    num_blocks: int


class RedisHolders:
    """Finds the live peer holding the longest run of a prompt's leading blocks in Redis."""

    RETRY_AFTER_S = 5.0  # after a failed lookup, requests skip Redis this long

    def __init__(self, url: str, namespace: str, replica_id: str, layout: KVLayout) -> None:
        self.client = aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self.ns = namespace
        self.replica_id = replica_id
        self.layout = layout
        self._down_until = 0.0

    async def best(self, hashes: list[BlockHash]) -> Holder | None:
        """None when no peer holds any of them, or Redis is unreachable (then not asked again
        for ``RETRY_AFTER_S``: a Redis outage must not add its timeout to every request)."""
        if time.monotonic() < self._down_until:
            return None
        try:
            return await self._best(hashes)
        except (RedisError, OSError) as exc:
            self._down_until = time.monotonic() + self.RETRY_AFTER_S
            log.warning("peer lookup in Redis failed: %s", exc)
            return None

    async def registered(self, replica_id: str, address: str) -> bool:
        """Whether ``replica_id`` holds a live lease at ``address`` (a hint is checked before
        this replica dials it with its API key)."""
        if time.monotonic() < self._down_until:
            return False
        try:
            lease = await self.client.hget(redis_layout.lease_key(replica_id, self.ns), "address")
        except (RedisError, OSError) as exc:
            self._down_until = time.monotonic() + self.RETRY_AFTER_S
            log.warning("checking a fetch hint in Redis failed: %s", exc)
            return False
        return lease is not None and lease.decode() == address

    async def _best(self, hashes: list[BlockHash]) -> Holder | None:
        ns = self.ns
        ids = [i.decode() for i in await self.client.smembers(redis_layout.replicas_key(ns))]
        peers = [i for i in ids if i != self.replica_id]
        if not peers or not hashes:
            return None
        async with self.client.pipeline(transaction=False) as pipe:
            for peer in peers:
                pipe.hmget(redis_layout.lease_key(peer, ns), "address", "model", "block_size")
                pipe.smismember(redis_layout.blocks_key(peer, ns), hashes)
            replies = await pipe.execute()
        best: Holder | None = None
        for peer, lease, present in zip(peers, replies[::2], replies[1::2]):
            address, model, block_size = (v.decode() if v else "" for v in lease)
            if not address or model != self.layout.model_id:
                continue
            if block_size != str(self.layout.block_size):
                continue
            held = next((i for i, p in enumerate(present) if not p), len(present))
            if held and (best is None or held > best.num_blocks):
                best = Holder(peer, address, held)
        return best

    async def close(self) -> None:
        await self.client.aclose()


class PeerFetcher:
    """Decides per request whether to fetch, and fetches; ``fetch`` returns tokens fetched."""

    def __init__(
        self,
        loop: EngineLoop,
        layout: KVLayout,
        block_shape: tuple[int, int, int],  # block_size, num_kv_heads, head_dim
        num_layers: int,
        dtype: torch.dtype,
        bytes_per_block: int,
        config: FetchConfig,
        api_key: str = "",
        tls: TlsFiles | None = None,
        holders: RedisHolders | None = None,
        metrics: ReplicaMetrics | None = None,
    ) -> None:
        self.loop = loop
        self.layout = layout
        self.block_shape = block_shape
        self.num_layers = num_layers
        self.dtype = dtype
        self.bytes_per_block = bytes_per_block
        self.config = config
        self.cost = FetchCost(config)
        self.api_key = api_key
        self.tls = tls
        self.holders = holders
        self.metrics = metrics
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.fetched_tokens = 0  # since start, for GetStats
        self.last_transfer: tuple[int, float] | None = None  # bytes, seconds (benchmarks)
        self._inflight: dict[BlockHash, asyncio.Future[int]] = {}  # by the deepest hash wanted

    async def fetch(self, request: EngineRequest, hint: pb.FetchHint | None) -> int:
        """Fetch the prompt's leading blocks from a peer if that pays; tokens fetched. The
        prompt's block hashes are computed here once and left in ``request.block_hashes`` for
        the engine's scheduler."""
        engine = self.loop.engine
        prompt = request.prompt
        assert isinstance(prompt, list)  # the wire mapping always tokenizes
        bs = self.layout.block_size
        cacheable = (len(prompt) - 1) // bs  # never the last token: it needs logits
        if request.block_hashes is None:
            request.block_hashes = engine.prompt_block_hashes(prompt, request.cache_salt)
        hashes = request.block_hashes[:cacheable]
        cache_salt = request.cache_salt
        if not hashes or not engine.config.enable_prefix_caching:
            return 0
        local = engine.cached_prefix_blocks(hashes)
        if local == len(hashes):  # held here already: nothing to gain, no Redis round trip
            return 0
        holder = await self._holder(hashes, local, hint)
        if holder is None or holder.num_blocks - local < self.config.min_blocks:
            return 0
        gain = holder.num_blocks - local
        if not self.cost.worth_it(gain * self.bytes_per_block, gain * bs):
            self.count("skipped_cost")
            return 0
        # One transfer per prefix: a burst of requests sharing it waits for the first one's
        # (in a task of its own, so a waiter or the first asker going away does not stop it).
        key = hashes[holder.num_blocks - 1]
        transfer = self._inflight.get(key)
        if transfer is None:
            transfer = asyncio.ensure_future(self._transfer(holder, hashes, local, cache_salt))
            self._inflight[key] = transfer
            transfer.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(transfer)

    async def _transfer(
        self, holder: Holder, hashes: list[BlockHash], local: int, cache_salt: str
    ) -> int:
        """Pull blocks ``local`` .. ``holder.num_blocks`` and insert them; tokens inserted."""
        bs = self.layout.block_size
        gain = holder.num_blocks - local
        deadline = min(self.config.timeout_s, max(0.5, 2 * self.cost.recompute_s(gain * bs)))
        started = time.monotonic()
        blocks, outcome = await self._pull(holder, hashes, local, cache_salt, deadline)
        fetched = await self.insert(blocks)
        seconds = time.monotonic() - started
        num_bytes = len(blocks) * self.bytes_per_block
        if outcome in ("fetched", "timeout"):
            self.cost.record_transfer(num_bytes, seconds)
        self.last_transfer = (num_bytes, seconds)
        self.fetched_tokens += fetched * bs
        self.count(outcome, fetched * bs, num_bytes)
        log.debug(
            "fetched %d of %d blocks from %s in %.3fs (%s)",
            fetched, gain, holder.replica_id, seconds, outcome,
        )  # fmt: skip
        return fetched * bs

    async def _holder(
        self, hashes: list[BlockHash], local: int, hint: pb.FetchHint | None
    ) -> Holder | None:
        if hint is not None and hint.address and hint.num_blocks > local:
            trusted = self.holders is None or await self.holders.registered(
                hint.replica_id, hint.address
            )
            if trusted:
                return Holder(hint.replica_id, hint.address, min(hint.num_blocks, len(hashes)))
            log.warning("fetch hint %s at %s has no lease: ignored", hint.replica_id, hint.address)
        if self.holders is None:
            return None
        return await self.holders.best(hashes)

    async def _pull(
        self,
        holder: Holder,
        hashes: list[BlockHash],
        start: int,
        cache_salt: str,
        timeout: float,
    ) -> tuple[list[pb.KVBlock], str]:
        """The blocks that arrived and check out, and how the transfer ended."""
        request = pb.FetchBlocksRequest(
            block_hashes=hashes[: holder.num_blocks],
            cache_salt=cache_salt,
            model=self.layout.model_id,
            dtype=self.layout.dtype,
            block_size=self.layout.block_size,
            hash_scheme=self.layout.hash_scheme,
            start=start,
        )
        stub = pb_grpc.ReplicaStub(self.channel(holder.address))
        call = stub.FetchBlocks(request, timeout=timeout, metadata=bearer_metadata(self.api_key))
        parent = hashes[start - 1] if start else root_hash(self.layout.model_id, cache_salt)
        blocks: list[pb.KVBlock] = []
        try:
            async for block in call:
                i = start + len(blocks)
                if i >= len(hashes) or block.block_hash != hashes[i]:
                    raise ValueError(f"block {i} is not the one asked for")
                if hash_block(parent, block.token_ids) != block.block_hash:
                    raise ValueError(f"block {i}'s tokens do not hash to it")
                block.parent_hash = parent if i else b""  # the first block's: the root
                blocks.append(block)
                parent = block.block_hash
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            log.warning("fetch from %s: %s: %s", holder.replica_id, code.name, exc.details())
            return blocks, "timeout" if code is grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
        except ValueError as exc:
            call.cancel()
            log.warning("fetch from %s: %s", holder.replica_id, exc)
            return blocks, "failed"
        return blocks, "fetched"

    async def insert(self, blocks: list[pb.KVBlock]) -> int:
        """Turn the received bytes into tensors (off both threads), then into the pool."""
        if not blocks:
            return 0
        try:
            fetched = await asyncio.to_thread(self._tensors, blocks)
        except ValueError as exc:  # a holder with a different geometry under the same name
            log.warning("fetched blocks do not fit this replica: %s", exc)
            return 0
        # During the engine's forward if one is running: the request this fetch is for is
        # submitted right after, so it joins the very next step instead of the one after.
        return await self.loop.call_now(lambda e: e.import_blocks(fetched))

    def _tensors(self, blocks: list[pb.KVBlock]) -> FetchedBlocks:
        shape, dtype = self.block_shape, self.dtype
        for b in blocks:
            if len(b.keys) != self.num_layers or len(b.values) != self.num_layers:
                raise ValueError(f"a block has {len(b.keys)} layers, expected {self.num_layers}")
        layers = range(self.num_layers)
        return FetchedBlocks(
            [b.block_hash for b in blocks],
            [tuple(b.token_ids) for b in blocks],
            [layer_tensor([b.keys[i] for b in blocks], dtype, shape) for i in layers],
            [layer_tensor([b.values[i] for b in blocks], dtype, shape) for i in layers],
            [b.parent_hash or None for b in blocks],
        )

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            options = [("grpc.max_receive_message_length", 64 * 2**20)]
            channel = self._channels[address] = aio_channel(address, self.tls, options)
        return channel

    def count(self, outcome: str, tokens: int = 0, num_bytes: int = 0) -> None:
        if self.metrics is not None:
            self.metrics.count_fetch(outcome, tokens, num_bytes)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self.holders is not None:
            await self.holders.close()
