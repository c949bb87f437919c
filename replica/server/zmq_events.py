"""Publishes this replica's KV cache changes in vLLM's event format (``--kv-events``).

So that schedulers written for vLLM (Dynamo's KV router, llm-d's precise prefix-cache scorer)
route our replicas as they route vLLM: msgpack ``EventBatch``es on a ZMQ PUB socket, numbered
from 0, with a ROUTER replay socket on the next port that resends what a subscriber missed
(``prefixmesh/vllm_events.py`` has the format). The Redis path stays as it is, beside this one.

The engine's callback gives hashes only; the block manager still holds the tokens and parent of
each stored block when the callback runs (at the end of the step, on the engine thread), so the
batch is built there. A hash stored and evicted within the same step is no longer cached: its
removal goes out, its store does not (the net effect is the same). Removals go before stores,
so a hash evicted and stored again in one step ends up present, as it is.

The sockets belong to one thread (ZMQ sockets are not thread-safe); the engine thread only puts
payloads on a queue, so publishing never blocks a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import zmq

from prefixmesh import vllm_events as ve

log = logging.getLogger(__name__)

BlockHash = bytes
BlockLookup = Callable[[BlockHash], tuple[tuple[int, ...] | None, BlockHash | None] | None]
REPLAY_BUFFER = 10_000  # batches kept for replay, as vLLM's default buffer_steps


def zmq_endpoint(url: str) -> str:
    """``zmq://*:5557`` (the flag's form) or ``tcp://...`` as a ZMQ endpoint."""
    if url.startswith("zmq://"):
        return "tcp://" + url[len("zmq://") :]
    if url.startswith(("tcp://", "ipc://", "inproc://")):
        return url
    raise ValueError(f"--kv-events wants zmq://HOST:PORT (e.g. zmq://*:5557), got {url!r}")


def replay_endpoint(endpoint: str) -> str:
    """The replay socket's endpoint: the event port + 1."""
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        raise ValueError(f"--kv-events needs an explicit TCP port, got {endpoint!r}")
    return f"{base}:{int(port) + 1}"


def build_batch(
    stored: Iterable[BlockHash], removed: Iterable[BlockHash], lookup: BlockLookup, block_size: int
) -> ve.EventBatch | None:
    """The vLLM-format batch of one engine step (None when nothing changed)."""
    events: list[ve.Event] = []
    removed = list(removed)
    if removed:
        events.append(ve.BlockRemoved(removed))
    for h in stored:
        info = lookup(h)
        if info is None or info[0] is None:
            continue  # evicted again within the step: its removal is already in the batch
        tokens, parent = info
        events.append(ve.BlockStored([h], parent, list(tokens), block_size))
    return ve.EventBatch(time.time(), events) if events else None


class ZmqEventPublisher:
    """PUB + replay sockets on one thread; ``publish`` is called from the engine thread."""

    def __init__(self, url: str, topic: str = "") -> None:
        self.endpoint = zmq_endpoint(url)
        self.replay = replay_endpoint(self.endpoint)
        self._topic = topic.encode()
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._pub.bind(self.endpoint)  # bind here: a taken port fails the replica's start
        self._router.bind(self.replay)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def publish(self, batch: ve.EventBatch) -> None:
        self._queue.put(ve.encode_batch(batch))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        self._router.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._router.poll(0):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if payload is None:
                return
            seq = ve.seq_bytes(self._seq)
            self._pub.send_multipart((self._topic, seq, payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._router.send_multipart((client, b"", self._topic, ve.seq_bytes(seq), payload))
        self._router.send_multipart((client, b"", b"", ve.END_SEQ, b""))


def engine_callback(
    publisher: ZmqEventPublisher, lookup: BlockLookup, block_size: int
) -> Callable[[list[BlockHash], list[BlockHash]], None]:
    """The engine's KV event callback that turns a step's changes into a published batch."""

    def on_events(stored: list[BlockHash], removed: list[BlockHash]) -> None:
        batch = build_batch(stored, removed, lookup, block_size)
        if batch is not None:
            publisher.publish(batch)

    return on_events
