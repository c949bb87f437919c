"""Our replica's engine seen by a vLLM-format consumer (``--kv-events``, zmq_events.py).

The consumer here is written from vLLM's message definitions (vllm/distributed/kv_events.py:
``(topic, 8-byte seq, msgpack EventBatch)``, events as maps tagged by ``type``), with pyzmq and
msgpack only: it does not use prefixmesh.vllm_events, so a drift of our encoder from vLLM's
format fails it. It rebuilds the cache from the events alone and must find, after evictions,
exactly the engine's cached blocks with their tokens.
"""

from __future__ import annotations

import random
import socket
import time

import msgpack
import zmq

from replica import LLM, SamplingParams
from replica.server.zmq_events import ZmqEventPublisher, engine_callback


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


class VllmStyleConsumer:
    """What Dynamo / llm-d do with the stream: apply BlockStored / BlockRemoved in seq order."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, tuple[bytes | None, list[int]]] = {}  # hash -> (parent, tokens)
        self.seqs: list[int] = []
        self.removed = 0

    def feed(self, frames: list[bytes]) -> None:
        _topic, seq, payload = frames
        self.seqs.append(int.from_bytes(seq, "big"))
        ts, events, *_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float)
        for ev in events:
            if ev["type"] == "BlockStored":
                size, parent = ev["block_size"], ev["parent_block_hash"]
                for i, h in enumerate(ev["block_hashes"]):
                    self.blocks[h] = (parent, ev["token_ids"][i * size : (i + 1) * size])
                    parent = h
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    self.removed += h in self.blocks
                    self.blocks.pop(h, None)
            elif ev["type"] == "AllBlocksCleared":
                self.blocks.clear()


def _drain(sub: zmq.Socket, consumer: VllmStyleConsumer, quiet_s: float = 0.5) -> None:
    while sub.poll(int(quiet_s * 1000)):
        consumer.feed(sub.recv_multipart())


def test_a_vllm_consumer_rebuilds_our_cache(tiny_model_dir) -> None:
    port = _free_port_pair()
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    engine, bm = llm.engine, llm.engine.block_manager
    publisher = ZmqEventPublisher(f"zmq://127.0.0.1:{port}", topic="kv")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the PUB socket
    engine.set_kv_event_callback(engine_callback(publisher, bm.cached_block, bm.block_size))
    consumer = VllmStyleConsumer()
    rng = random.Random(5)
    shared = [rng.randrange(5, 400) for _ in range(48)]
    one = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        for _ in range(12):  # 24 blocks for ~7 blocks a prompt: later prompts evict
            prompt = shared[: rng.randrange(0, 48)] + [rng.randrange(5, 400) for _ in range(80)]
            llm.generate([prompt], one)
            engine.check_integrity()
        _drain(sub, consumer)
        cached = engine.cached_block_hashes()
        assert consumer.seqs == list(range(len(consumer.seqs))) and consumer.seqs
        assert consumer.removed > 0, "the workload should have evicted blocks"
        assert set(consumer.blocks) == cached
        for h, (parent, tokens) in consumer.blocks.items():
            assert bm.cached_block(h) == (tuple(tokens), parent)

        replayed = VllmStyleConsumer()  # a late subscriber catches up through replay
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port + 1}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while dealer.poll(2000):
            _empty, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.feed([topic, seq, payload])
        dealer.close(linger=0)
        assert replayed.seqs == consumer.seqs and set(replayed.blocks) == cached
    finally:
        sub.close(linger=0)
        publisher.close()
