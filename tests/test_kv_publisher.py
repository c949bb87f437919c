"""KVPublisher against a real redis-server: exact block sets, resync, ordering, lease expiry.

A fake engine thread stands in for the engine: it owns a set of block hashes and reports every
change through the KVEventBuffer, exactly as the engine's KV event callback does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from helpers import free_port, start_redis

from prefixmesh import redis_layout as layout
from prefixmesh.kv_events import RESET, KVEvent
from replica.server.kv_publisher import KVEventBuffer, KVPublisher, net_changes

NS = "pmtest"
RID = "r1"


class FakeEngineThread:
    """One thread owning a block set, reporting stored/removed events like the engine does."""

    def __init__(self, buffer: KVEventBuffer) -> None:
        self.buffer = buffer
        self.blocks: set[bytes] = set()
        self._q: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._q.put((fn, fut))
        return fut

    def change(self, stored: list[bytes], removed: list[bytes]) -> None:
        def apply() -> None:
            new = [h for h in stored if h not in self.blocks]
            gone = [h for h in removed if h in self.blocks]
            self.blocks |= set(new)
            self.blocks -= set(gone)
            self.buffer.append(new, gone)

        self.call(apply).result()

    async def snapshot(self) -> set[bytes]:
        fut = self.call(lambda: self.buffer.cut(lambda: set(self.blocks)))
        return await asyncio.wrap_future(fut)

    def state(self) -> set[bytes]:
        return self.call(lambda: set(self.blocks)).result()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Harness:
    """A publisher running on its own event loop thread, with a fake engine behind it."""

    def __init__(self, url: str) -> None:
        self.buffer = KVEventBuffer()
        self.engine = FakeEngineThread(self.buffer)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        load = {"running": 1, "waiting": 2, "kv_usage": 0.25, "queued_tokens": 7,
                "num_blocks": 64}  # fmt: skip
        lease = {"address": "127.0.0.1:1", "model": "tiny", "block_size": 16,
                 "hash_scheme": "xxh3-128-v1"}  # fmt: skip

        async def make() -> KVPublisher:
            pub = KVPublisher(
                url, RID, lease, lambda: load, self.engine.snapshot, self.buffer, namespace=NS
            )
            pub.start()
            return pub

        self.pub = self.run(make())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(15)

    def close(self, deregister: bool = True) -> None:
        self.run(self.pub.close(deregister=deregister))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()
        self.engine.close()


@pytest.fixture
def harness(redis_server: str):
    hs = Harness(redis_server)
    yield hs
    hs.close()


def redis_blocks(client: redis.Redis) -> set[bytes]:
    return set(client.smembers(layout.blocks_key(RID, NS)))


def wait_equal(client: redis.Redis, engine: FakeEngineThread, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = redis_blocks(client)
        except redis.ConnectionError:
            got = None
        want = engine.state()
        if got == want:
            return
        if time.monotonic() > deadline:
            missing = len(want - (got or set()))
            extra = len((got or set()) - want)
            raise AssertionError(f"Redis differs from engine: {missing} missing, {extra} extra")
        time.sleep(0.02)


def test_net_changes_last_event_wins() -> None:
    events = [([h(1), h(2)], []), ([], [h(1), h(3)]), ([h(3)], [h(2)])]
    added, removed = net_changes(events)
    assert added == {h(3)}
    assert removed == {h(1), h(2)}


def test_buffer_drops_events_until_cut() -> None:
    buf = KVEventBuffer()
    buf.append([h(1)], [])
    assert buf.drain() == []  # before the first resync nothing is worth keeping
    assert buf.cut(lambda: {h(9)}) == {h(9)}
    buf.append([h(2)], [h(9)])
    assert buf.drain() == [([h(2)], [h(9)])]
    buf.invalidate()
    buf.append([h(3)], [])
    assert len(buf) == 0


def test_events_keep_redis_exact_and_lease_is_published(harness: Harness, redis_server: str):
    client = redis.Redis.from_url(redis_server)
    harness.engine.change([h(i) for i in range(100)], [])
    harness.engine.change([h(i) for i in range(100, 150)], [h(i) for i in range(0, 100, 3)])
    harness.engine.change([h(3)], [h(140)])  # re-store a removed hash
    wait_equal(client, harness.engine)
    lease = client.hgetall(layout.lease_key(RID, NS))
    assert lease[b"model"] == b"tiny" and lease[b"block_size"] == b"16"
    assert lease[b"epoch"].decode() == harness.pub.epoch
    assert lease[b"running"] == b"1" and lease[b"queued_tokens"] == b"7"
    assert 0 < client.pttl(layout.lease_key(RID, NS)) <= layout.LEASE_TTL_MS
    assert 0 < client.pttl(layout.blocks_key(RID, NS)) <= layout.BLOCKS_TTL_MS
    assert client.get(layout.blocks_epoch_key(RID, NS)).decode() == harness.pub.epoch
    assert client.sismember(layout.replicas_key(NS), RID)
    # The load is refreshed continuously (at least every 200 ms).
    first = float(client.hget(layout.lease_key(RID, NS), "updated_at"))
    time.sleep(0.5)
    assert float(client.hget(layout.lease_key(RID, NS), "updated_at")) > first
    client.close()


def test_resync_after_flushall_and_deleted_keys(harness: Harness, redis_server: str):
    client = redis.Redis.from_url(redis_server)
    harness.engine.change([h(i) for i in range(40)], [])
    wait_equal(client, harness.engine)
    resyncs = harness.pub.resyncs
    client.flushall()
    wait_equal(client, harness.engine)
    assert client.exists(layout.lease_key(RID, NS))
    client.srem(layout.blocks_key(RID, NS), h(5))  # someone tampered with the set
    wait_equal(client, harness.engine)
    assert harness.pub.resyncs >= resyncs + 2
    client.close()


def test_events_during_resyncs_are_neither_lost_nor_reordered(harness: Harness, redis_server):
    client = redis.Redis.from_url(redis_server)
    stop = threading.Event()

    def churn() -> None:
        # Store, remove and re-store overlapping hashes: any reordering leaves a wrong set.
        i = 0
        while not stop.is_set() and i < 3000:
            harness.engine.change([h(i % 97), h(i % 89 + 200)], [h((i * 7) % 97)])
            i += 1

    producer = threading.Thread(target=churn)
    producer.start()
    try:
        for _ in range(5):
            time.sleep(0.1)
            client.flushall()
    finally:
        stop.set()
        producer.join(30)
    wait_equal(client, harness.engine)
    client.close()


def test_redis_restart_and_outage_resync() -> None:
    server = start_redis()
    hs = Harness(server.url)
    try:
        client = redis.Redis.from_url(server.url)
        hs.engine.change([h(i) for i in range(30)], [])
        wait_equal(client, hs.engine)
        client.close()
        server.stop()
        # Serving goes on while Redis is down: the engine keeps changing its cache.
        hs.engine.change([h(i) for i in range(30, 60)], [h(i) for i in range(10)])
        time.sleep(0.5)
        assert not hs.pub.connected
        server.start()
        client = redis.Redis.from_url(server.url)
        wait_equal(client, hs.engine, timeout=10)
        assert hs.pub.connected
        assert client.hget(layout.lease_key(RID, NS), "epoch").decode() == hs.pub.epoch
        client.close()
    finally:
        hs.close()
        server.stop()


def test_redis_down_at_start_publishes_once_it_comes_up() -> None:
    port = free_port()
    hs = Harness(f"redis://127.0.0.1:{port}")
    server = None
    try:
        hs.engine.change([h(i) for i in range(5)], [])
        time.sleep(0.3)
        assert not hs.pub.connected and hs.pub.errors > 0
        server = start_redis(port)
        client = redis.Redis.from_url(server.url)
        wait_equal(client, hs.engine, timeout=10)
        client.close()
    finally:
        hs.close(deregister=False)
        if server is not None:
            server.stop()


def test_every_change_is_on_the_event_stream_numbered_like_kv_seq(
    harness: Harness, redis_server: str
):
    client = redis.Redis.from_url(redis_server)
    deadline = time.monotonic() + 5
    while harness.pub.resyncs == 0:  # the first resync (of an empty cache) is the reset
        assert time.monotonic() < deadline
        time.sleep(0.01)
    harness.engine.change([h(i) for i in range(20)], [])
    harness.engine.change([h(20)], [h(0), h(1)])
    wait_equal(client, harness.engine)
    time.sleep(0.05)
    events = [
        KVEvent.parse(fields)
        for _, fields in client.xrange(layout.kv_events_key(NS))
        if fields[b"i"] == RID.encode()
    ]
    assert events[0].kind == RESET and events[0].epoch == harness.pub.epoch
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert int(client.hget(layout.lease_key(RID, NS), "kv_seq")) == events[-1].seq
    # Replaying the deltas after the reset gives Redis' set.
    replayed: set[bytes] = set()
    for e in events[1:]:
        replayed = (replayed - set(e.removed)) | set(e.added)
    assert replayed == redis_blocks(client) == harness.engine.state()
    assert 0 < client.pttl(layout.kv_events_key(NS)) <= layout.BLOCKS_TTL_MS
    client.close()


def test_dead_replica_lease_expires_and_blocks_have_ttl(harness: Harness, redis_server: str):
    client = redis.Redis.from_url(redis_server)
    harness.engine.change([h(i) for i in range(10)], [])
    wait_equal(client, harness.engine)
    # Simulate a crash: stop refreshing without deregistering.
    harness.run(harness.pub.close(deregister=False))
    died = time.monotonic()
    while client.exists(layout.lease_key(RID, NS)):
        assert time.monotonic() - died < 3.5, "lease outlived the replica by more than 3 s"
        time.sleep(0.05)
    ttl = client.pttl(layout.blocks_key(RID, NS))
    assert 0 < ttl <= layout.BLOCKS_TTL_MS  # the set goes away on its own too
    client.close()
    harness.pub = _closed_stub()


def test_deregister_removes_every_key(redis_server: str):
    hs = Harness(redis_server)
    client = redis.Redis.from_url(redis_server)
    hs.engine.change([h(1), h(2)], [])
    wait_equal(client, hs.engine)
    hs.close(deregister=True)
    assert not client.exists(layout.lease_key(RID, NS), layout.blocks_key(RID, NS),
                             layout.blocks_epoch_key(RID, NS))  # fmt: skip
    assert not client.sismember(layout.replicas_key(NS), RID)
    client.close()


def _closed_stub() -> Any:
    class Closed:
        async def close(self, deregister: bool = True) -> None:
            return None

    return Closed()
