"""An engine followed over real ZMQ sockets, joining late: the replay rebuilds what it missed.

The engine side is our replica's vLLM-format publisher (replica/server/zmq_events.py), which
tests/test_replica_kv_events.py holds to vLLM's format; the batches are a prompt tree whose
expected view is our own hashing of the prompts.
"""

from __future__ import annotations

import asyncio
import socket

from prefixmesh import vllm_events as ve
from prefixmesh.hashing import block_hashes
from replica.server.zmq_events import ZmqEventPublisher
from router.engines.follower import EventFollower
from router.engines.subscriber import EngineSubscriber
from router.engines.translate import EngineCacheView


def _port_pair() -> int:
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            try:
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
            except OSError:
                continue
            return a.getsockname()[1]


def _stored(prompt: list[int], parent: int | None, first: int, size: int = 32) -> ve.BlockStored:
    n = len(prompt) // size
    return ve.BlockStored(list(range(first, first + n)), parent, prompt[: n * size], size)


def test_a_late_subscriber_catches_up_through_replay() -> None:
    port = _port_pair()
    pub = ZmqEventPublisher(f"zmq://127.0.0.1:{port}")
    base = list(range(1, 97))  # 3 engine blocks: hashes 100, 101, 102
    tails = [[500 + i] * 64 for i in range(3)]  # 2 blocks each, chained on 102
    batches = [ve.EventBatch(0.0, [_stored(base, None, 100)])]
    batches += [ve.EventBatch(0.0, [_stored(t, 102, 200 + 10 * i)]) for i, t in enumerate(tails)]
    batches.append(ve.EventBatch(0.0, [ve.BlockRemoved([210, 211])]))  # tails[1] evicted
    expected = set(block_hashes(base + tails[0], 16, "smollm2"))
    expected |= set(block_hashes(base + tails[2], 16, "smollm2"))

    async def scenario() -> EngineSubscriber:
        for b in batches[:3]:  # published before anyone listens: only the replay has them
            pub.publish(b)
        await asyncio.sleep(0.3)
        sub = EngineSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}",
                               EventFollower(EngineCacheView("smollm2", 16)), lambda d: None)  # fmt: skip
        task = asyncio.create_task(sub.run())
        await asyncio.sleep(0.5)  # the slow joiner's subscription
        for b in batches[3:]:
            pub.publish(b)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if sub.follower.next_seq == len(batches):
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sub

    try:
        sub = asyncio.run(scenario())
    finally:
        pub.close()
    assert sub.replays >= 1 and sub.follower.clears == 0
    assert sub.follower.view.hashes == expected
