"""Replicas fetching a prompt's KV blocks from each other (in-process servers, tiny model):
FetchBlocks itself, fetch-on-miss in Generate, the fallbacks, and the checks on the wire."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio

from prefixmesh.auth import bearer_metadata
from prefixmesh.hashing import HASH_SCHEME, block_hashes
from prefixmesh.tls import aio_channel
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from replica.fetch import holder as block_service
from replica.fetch.client import FetchConfig, FetchCost
from replica.server.config import ServerConfig
from replica.server.server import ReplicaServer

KEY = "fetch-key"
BS = 16


def prompt(n: int = 100, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 400) for _ in range(n)]


class Replica:
    """One in-process replica server and an async channel to it (sending the API key)."""

    def __init__(self, server: ReplicaServer) -> None:
        self.server = server
        self.address = f"127.0.0.1:{server.port}"
        self.channel = aio_channel(self.address, None)
        self.gen = pb_grpc.GeneratorStub(self.channel)
        self.admin = pb_grpc.ReplicaStub(self.channel)
        if server.fetcher is not None:  # a fixed prefill speed: the choice must not flip
            server.fetcher.cost.record_prefill = lambda tokens, seconds: None

    @property
    def engine(self):
        return self.server.engine

    async def generate(self, ids: list[int], **kw) -> tuple[list[int], pb.Usage]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            **kw,
        )
        tokens: list[int] = []
        usage = pb.Usage()
        async for msg in self.gen.Generate(request, metadata=bearer_metadata(KEY), timeout=60):
            tokens += msg.token_ids
            if msg.finish_reason:
                usage = msg.usage
        return tokens, usage

    def hint(self, num_blocks: int) -> pb.FetchHint:
        return pb.FetchHint(
            replica_id=self.server.replica_id, address=self.address, num_blocks=num_blocks
        )

    async def idle_and_sound(self) -> None:
        """Integrity holds, nothing is referenced, no block is pinned (asked of the engine
        thread directly, so it works on a replica whose port is already closed)."""
        deadline = time.monotonic() + 10
        while True:
            stats = await self.server.loop.call(lambda e: e.get_stats())
            if stats.free_blocks == stats.num_blocks and not self.server.admission.num_inflight:
                break
            assert time.monotonic() < deadline, f"not idle: {stats}"
            await asyncio.sleep(0.05)
        await self.server.loop.call(lambda e: e.check_integrity())
        assert self.engine.num_pinned_blocks == 0


@contextlib.asynccontextmanager
async def replicas(
    model_dir: Path, count: int = 2, dtype: str = "float32", **overrides
) -> AsyncIterator[list[Replica]]:
    from replica.engine import LLMEngine

    started: list[Replica] = []
    try:
        for i in range(count):
            settings = dict(
                port=0, replica_id=f"fetch-{i}", model=str(model_dir), dtype=dtype,
                block_size=BS, num_blocks=64, max_model_len=512, threads=1, api_key=KEY,
                fetch_prefill_tokens_per_s=100.0,
            )  # fmt: skip
            config = ServerConfig(**{**settings, **overrides})
            server = ReplicaServer(config, LLMEngine(config.engine_config()))
            await server.start()
            started.append(Replica(server))
        yield started
        for rep in started:
            await rep.idle_and_sound()
    finally:
        for rep in started:
            await rep.channel.close()
            await rep.server.shutdown()


def fetch_request(engine, ids: list[int], **kw) -> pb.FetchBlocksRequest:
    fields = dict(
        block_hashes=block_hashes(ids, BS, engine.model_id, kw.pop("salt", None)),
        model=engine.model_id, dtype=str(engine.dtype).removeprefix("torch."),
        block_size=BS, hash_scheme=HASH_SCHEME,
    )  # fmt: skip
    fields.update(kw)
    return pb.FetchBlocksRequest(**fields)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fetched_prefix_gives_the_cold_output(tiny_model_dir, dtype):
    async def go() -> None:
        async with replicas(tiny_model_dir, dtype=dtype) as (a, b):
            ids = prompt(100)
            await a.generate(ids)
            asked = ids + prompt(20, seed=5)
            fetched, usage = await b.generate(asked, fetch_hint=a.hint(6))
            assert usage.cached_tokens == 96 and usage.fetched_tokens == 96
            md = bearer_metadata(KEY)
            assert (await b.admin.GetStats(pb.Empty(), metadata=md)).fetched_tokens == 96
            assert (await a.admin.GetStats(pb.Empty(), metadata=md)).blocks_served == 6
            labels = {"model": b.engine.model_id, "replica": "fetch-1"}
            sample = b.server.metrics.registry.get_sample_value
            assert sample("prefixmesh_fetched_tokens_total", labels) == 96
            assert sample("prefixmesh_kv_fetches_total", {**labels, "outcome": "fetched"}) == 1
            # The same prompt cold on B: prefix cache dropped, no hint.
            await b.server.loop.call(lambda e: e.reset_prefix_cache())
            cold, cold_usage = await b.generate(asked)
            assert cold_usage.cached_tokens == 0 and cold_usage.fetched_tokens == 0
            assert fetched == cold
            # B now holds the blocks itself: the next request hits without fetching.
            _, again = await b.generate(asked, fetch_hint=a.hint(6))
            assert again.cached_tokens == 112 and again.fetched_tokens == 0

    asyncio.run(go())


def test_fetch_blocks_streams_the_held_prefix_pinned(tiny_model_dir, monkeypatch):
    pinned_while_read: list[int] = []

    async def go() -> None:
        async with replicas(tiny_model_dir, count=1) as (a,):
            read = block_service.read_blocks

            def read_pinned(kv_caches, blocks):  # what is pinned while the KV is read
                pinned_while_read.append(a.engine.num_pinned_blocks)
                return read(kv_caches, blocks)

            # Checked inside the read, not after the client's first message: gRPC may have
            # sent every block, and the server unpinned them, before the client reads one.
            monkeypatch.setattr(block_service, "read_blocks", read_pinned)
            ids = prompt(100)
            await a.generate(ids)
            longer = ids + prompt(40, seed=9)  # the holder has 6 of its 8 blocks
            call = a.admin.FetchBlocks(
                fetch_request(a.engine, longer), metadata=bearer_metadata(KEY), timeout=10
            )
            first = await call.read()
            assert list(first.token_ids) == ids[:BS]
            assert len(first.keys) == len(first.values) == 2  # the tiny model's layers
            assert pinned_while_read == [6]
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
            wanted = block_hashes(longer, BS, a.engine.model_id)[:6]
            assert [m.block_hash for m in [first, *rest]] == wanted
            assert [list(m.token_ids) for m in rest] == [
                ids[i * BS : (i + 1) * BS] for i in range(1, 6)
            ]
            await a.idle_and_sound()
            # A peer that goes away mid-stream releases the pin too.
            call = a.admin.FetchBlocks(
                fetch_request(a.engine, ids, start=2), metadata=bearer_metadata(KEY)
            )
            assert (await call.read()).block_hash == block_hashes(ids, BS, a.engine.model_id)[2]
            call.cancel()
            await a.idle_and_sound()

    asyncio.run(go())


def test_mismatched_layout_and_missing_key_get_clean_statuses(tiny_model_dir):
    async def go() -> None:
        async with replicas(tiny_model_dir, count=1) as (a,):
            ids = prompt(40)
            await a.generate(ids)
            cases = [
                (dict(dtype="bfloat16"), grpc.StatusCode.FAILED_PRECONDITION, "dtype"),
                (dict(block_size=32), grpc.StatusCode.FAILED_PRECONDITION, "block_size"),
                (dict(model="other"), grpc.StatusCode.FAILED_PRECONDITION, "model"),
                (dict(hash_scheme="v0"), grpc.StatusCode.FAILED_PRECONDITION, "hash_scheme"),
                (dict(model=""), grpc.StatusCode.INVALID_ARGUMENT, "required"),
                (dict(block_hashes=[b"short"]), grpc.StatusCode.INVALID_ARGUMENT, "16 bytes"),
            ]
            for fields, code, words in cases:
                call = a.admin.FetchBlocks(
                    fetch_request(a.engine, ids, **fields), metadata=bearer_metadata(KEY)
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == code and words in err.value.details(), fields
            for metadata in ((), bearer_metadata("wrong")):
                call = a.admin.FetchBlocks(fetch_request(a.engine, ids), metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(go())


def test_another_salts_blocks_are_not_served(tiny_model_dir):
    async def go() -> None:
        async with replicas(tiny_model_dir) as (a, b):
            ids = prompt(100)
            await a.generate(ids, cache_salt="tenant-a")
            salted = block_hashes(ids, BS, a.engine.model_id, "tenant-a")
            md = bearer_metadata(KEY)
            for salt in ("", "tenant-b"):  # the hashes, read from Redis, without the salt
                req = fetch_request(a.engine, ids, block_hashes=salted, cache_salt=salt)
                assert [m async for m in a.admin.FetchBlocks(req, metadata=md)] == []
            req = fetch_request(a.engine, ids, salt="tenant-a", cache_salt="tenant-a")
            assert len([m async for m in a.admin.FetchBlocks(req, metadata=md)]) == 6
            # Through Generate: another tenant's request on B fetches nothing and is right.
            out_b, usage = await b.generate(ids, cache_salt="tenant-b", fetch_hint=a.hint(6))
            assert usage.cached_tokens == 0 and usage.fetched_tokens == 0
            out_a, usage = await b.generate(ids, cache_salt="tenant-a", fetch_hint=a.hint(6))
            assert usage.fetched_tokens == 96
            assert out_a == out_b

    asyncio.run(go())


def test_source_failing_mid_fetch_falls_back_to_prefill(tiny_model_dir, monkeypatch):
    read = block_service.read_blocks

    reads = []  # blocks read for sending so far

    def slow_read(kv_caches, blocks):
        time.sleep(0.3)
        out = read(kv_caches, blocks)
        reads.append(len(blocks))
        return out

    monkeypatch.setattr(block_service, "READ_CHUNK", 1)
    monkeypatch.setattr(block_service, "read_blocks", slow_read)

    async def go() -> None:
        async with replicas(tiny_model_dir, count=3) as (a, b, cold):
            ids = prompt(100)
            await a.generate(ids)
            expected, _ = await cold.generate(ids)
            task = asyncio.create_task(b.generate(ids, fetch_hint=a.hint(6)))
            for _ in range(300):  # a few blocks are on their way (bounded: 30 s)
                if len(reads) >= 3:
                    break
                await asyncio.sleep(0.1)
            await a.server._server.stop(grace=0)  # the holder dies mid-transfer
            out, usage = await task
            assert out == expected
            assert 0 < usage.fetched_tokens < 96, usage  # what arrived is kept
            assert usage.cached_tokens == usage.fetched_tokens
            for _ in range(100):  # the unpin is posted to the engine thread (bounded: 10 s)
                if a.engine.num_pinned_blocks == 0:
                    break
                await asyncio.sleep(0.1)
            assert a.engine.num_pinned_blocks == 0
            # A holder that is not there at all: prefilled, same output, no error.
            await b.server.loop.call(lambda e: e.reset_prefix_cache())
            dead = pb.FetchHint(replica_id="gone", address="127.0.0.1:1", num_blocks=6)
            out, usage = await b.generate(ids, fetch_hint=dead)
            assert out == expected and usage.cached_tokens == 0

    asyncio.run(go())


def test_a_fetch_that_times_out_makes_fetching_cost_more(tiny_model_dir, monkeypatch):
    """A holder too busy to answer in time (here: its read takes 3 s; the deadline is twice the
    prefill it saves, 1.9 s) costs the asker that time for nothing: its measured transfer
    speed, and so the fetch cost its lease tells routers, go up. The request is prefilled."""
    read = block_service.read_blocks

    def slow_read(kv_caches, blocks):
        time.sleep(3.0)
        return read(kv_caches, blocks)

    monkeypatch.setattr(block_service, "read_blocks", slow_read)

    async def go() -> None:
        async with replicas(tiny_model_dir, count=2) as (a, b):
            ids = prompt(100)
            expected, _ = await a.generate(ids)
            before = float(b.server._load_fields()["fetch_cost"])
            out, usage = await b.generate(ids, fetch_hint=a.hint(6))
            assert out == expected and usage.fetched_tokens == 0 and usage.cached_tokens == 0
            assert float(b.server._load_fields()["fetch_cost"]) > 1.3 * before

    asyncio.run(go())


def test_fetch_found_through_redis(tiny_model_dir, redis_server):
    async def go() -> None:
        async with replicas(tiny_model_dir, redis=redis_server, namespace="fetch") as (a, b):
            ids = prompt(100)
            await a.generate(ids)
            key = f"fetch:blocks:{a.server.replica_id}"
            hashes = block_hashes(ids, BS, a.engine.model_id)
            client = b.server.fetcher.holders.client
            deadline = time.monotonic() + 10
            while not all(await client.smismember(key, hashes)):
                assert time.monotonic() < deadline, "A's blocks never reached Redis"
                await asyncio.sleep(0.05)
            # A hint whose address no lease names is not dialled; Redis names the holder.
            bogus = pb.FetchHint(replica_id=a.server.replica_id, address="127.0.0.1:1",
                                 num_blocks=6)  # fmt: skip
            _, usage = await b.generate(ids + [9, 9, 9], fetch_hint=bogus)
            assert usage.fetched_tokens == 96
            sample = b.server.metrics.registry.get_sample_value
            labels = {"model": b.engine.model_id, "replica": "fetch-1", "outcome": "fetched"}
            assert sample("prefixmesh_kv_fetches_total", labels) == 1  # no failed try first
            # B's KV events announce the fetched blocks under their own hashes.
            key_b = f"fetch:blocks:{b.server.replica_id}"
            while not all(await client.smismember(key_b, hashes)):
                assert time.monotonic() < deadline, "B never announced the fetched blocks"
                await asyncio.sleep(0.05)

    asyncio.run(go())


def test_cost_model_fetches_only_when_cheaper(tiny_model_dir):
    cost = FetchCost(FetchConfig(bytes_per_s=100e6, prefill_tokens_per_s=1000, latency_s=0.01))
    assert cost.worth_it(num_bytes=1_000_000, num_tokens=1024)  # 20 ms vs 1 s
    assert not cost.worth_it(num_bytes=1_000_000, num_tokens=16)  # 20 ms vs 16 ms
    cost.record_prefill(100_000, 1.0)  # a much faster prefill measured
    assert cost.prefill_tokens_per_s > 1000
    cost.record_transfer(10_000_000, 10.0)  # a slow link measured
    assert cost.bytes_per_s < 100e6

    async def go() -> None:
        async with replicas(tiny_model_dir, fetch_mb_per_s=0.001) as (a, b):
            ids = prompt(100)
            await a.generate(ids)
            _, usage = await b.generate(ids, fetch_hint=a.hint(6))
            assert usage.fetched_tokens == 0 and usage.cached_tokens == 0

    asyncio.run(go())


def test_the_lease_prices_a_fetched_token_against_a_prefilled_one(tiny_model_dir):
    # fetch_cost = (bytes of one token's KV / bytes per second) * prefill tokens per second:
    # what routers weigh a prefix held elsewhere with. A replica that does not fetch has none.
    cost = FetchCost(FetchConfig(bytes_per_s=100e6, prefill_tokens_per_s=1000))
    assert cost.token_cost(50_000) == pytest.approx(0.5)  # 0.5 ms to fetch, 1 ms to prefill
    cost.record_transfer(10_000_000, 10.0)  # a slower link: fetching costs more
    assert cost.token_cost(50_000) > 0.5

    async def go() -> None:
        async with replicas(tiny_model_dir, count=1, fetch_mb_per_s=10.0) as (a,):
            fields = a.server._load_fields()
            per_token = a.server.fetcher.bytes_per_block / BS
            expected = per_token / 10e6 * a.server.fetcher.cost.prefill_tokens_per_s
            assert float(fields["fetch_cost"]) == pytest.approx(expected, rel=1e-3)
        async with replicas(tiny_model_dir, count=1, fetch=False) as (c,):
            assert "fetch_cost" not in c.server._load_fields()

    asyncio.run(go())


def test_unreachable_redis_is_not_asked_on_every_request(tiny_model_dir):
    from replica.fetch.client import RedisHolders
    from replica.fetch.layout import KVLayout

    async def go() -> None:
        holders = RedisHolders("redis://127.0.0.1:1/0", "x", "me", KVLayout("m", "float32", BS))
        assert await holders.best([b"\0" * 16]) is None  # refused: logged, not raised
        started = time.monotonic()
        assert await holders.best([b"\0" * 16]) is None  # within RETRY_AFTER_S: not asked
        assert time.monotonic() - started < 0.01
        await holders.close()

    asyncio.run(go())


def test_a_burst_sharing_a_prefix_fetches_it_once(tiny_model_dir):
    async def go() -> None:
        async with replicas(tiny_model_dir) as (a, b):
            ids = prompt(100)
            await a.generate(ids)
            results = await asyncio.gather(
                *(b.generate(ids + [i, i], fetch_hint=a.hint(6)) for i in range(4))
            )
            assert all(usage.fetched_tokens == 96 for _, usage in results)
            stats = await a.admin.GetStats(pb.Empty(), metadata=bearer_metadata(KEY))
            assert stats.blocks_served == 6  # one transfer, not four

    asyncio.run(go())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_fetches_a_1500_token_prefix(smollm2_files, dtype):
    """The issue's case: 1,500 tokens on A, the same plus a suffix on B; B's output equals a
    cold run on B. In batch-invariant mode, so in bfloat16 too: without it, oneDNN's AMX
    matmuls round the 28-row suffix step and the 1,500-row prefix step differently from the
    cold 1,516-row step, and this prompt's greedy output differs from the 4th token on
    (docs/fetch.md, "bfloat16 and exact equality")."""

    async def go() -> None:
        overrides = dict(dtype=dtype, num_blocks=256, max_model_len=2048, threads=0,
                         max_num_batched_tokens=2048, batch_invariant=True)  # fmt: skip
        async with replicas("smollm2", **overrides) as (a, b):
            vocab = int(a.engine.model_config.vocab_size)
            rng = random.Random(3)
            ids = [rng.randrange(100, vocab) for _ in range(1500)]
            asked = ids + [rng.randrange(100, vocab) for _ in range(16)]
            await a.generate(ids)
            fetched, usage = await b.generate(asked, fetch_hint=a.hint(93))
            assert usage.cached_tokens >= 1488 and usage.fetched_tokens >= 1488
            held, _ = await a.generate(asked)  # A's own hit on the very same KV
            assert fetched == held
            await b.server.loop.call(lambda e: e.reset_prefix_cache())
            cold, cold_usage = await b.generate(asked)
            assert cold_usage.cached_tokens == 0 and fetched == cold

    asyncio.run(go())


def test_warm_start_prefetches_the_hot_prefix(tiny_model_dir, redis_server):
    """A replica joining with --warm-start-share pulls the chains its peer holds (bounded by
    the share), never a salted tenant's, after it already serves; requests then hit locally."""
    from replica.engine import LLMEngine

    async def go() -> None:
        async with replicas(tiny_model_dir, 1, redis=redis_server, namespace="warm") as (a,):
            hot = prompt(100)
            for seed in range(3):
                await a.generate(hot + prompt(20, seed=10 + seed))
            secret = prompt(100, seed=7)
            await a.generate(secret, cache_salt="tenant")
            model = a.engine.model_id
            hot_hashes = block_hashes(hot, BS, model)
            secret_hashes = block_hashes(secret, BS, model, "tenant")
            client = redis.asyncio.Redis.from_url(redis_server)
            deadline = time.monotonic() + 10
            while not all(await client.smismember("warm:blocks:fetch-0", secret_hashes)):
                assert time.monotonic() < deadline, "A's blocks never reached Redis"
                await asyncio.sleep(0.05)
            await client.aclose()
            config = ServerConfig(
                port=0, replica_id="fetch-1", model=str(tiny_model_dir), dtype="float32",
                block_size=BS, num_blocks=64, max_model_len=512, threads=1, api_key=KEY,
                redis=redis_server, namespace="warm", warm_start_share=0.25,
            )  # fmt: skip
            server = ReplicaServer(config, LLMEngine(config.engine_config()))
            await server.start()  # returns serving, the warm start in the background
            b = Replica(server)
            try:
                assert server.warm_start is not None
                inserted = await asyncio.wait_for(server.warm_start, 30)
                manager = b.engine.block_manager
                assert 6 <= inserted <= 16  # a quarter of 64 blocks at most
                assert len(manager.match_prefix(hot_hashes)) == 6
                assert not manager.match_prefix(secret_hashes[:1])  # another salt's: never
                ids = hot + [9, 9, 9]
                tokens, usage = await b.generate(ids)
                assert usage.cached_tokens == 96 and usage.fetched_tokens == 0
                await b.server.loop.call(lambda e: e.reset_prefix_cache())
                cold, cold_usage = await b.generate(ids, cache_salt="cold")
                assert cold_usage.cached_tokens == 0 and tokens == cold
                await b.idle_and_sound()
            finally:
                await b.channel.close()
                await server.shutdown()

    asyncio.run(go())
