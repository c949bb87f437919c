"""Drives an ``EventFollower`` from one engine's ZMQ sockets (PUB events, ROUTER replay).

One asyncio task per engine: it reads the PUB socket, and whenever the follower reports a gap
(``replay_from``) it asks the replay socket from that number and hands the follower what comes
back, up to vLLM's end marker. Each change in our hashes goes to ``on_delta``, in order; the
task that writes them into Redis (the engine agent) is the part still to be built.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from prefixmesh import vllm_events as ve
from router.engines.follower import EventFollower
from router.engines.translate import Delta

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0


class EngineSubscriber:
    """Follows one engine's events at ``endpoint`` (replay at ``replay``, or none)."""

    def __init__(
        self,
        endpoint: str,
        replay: str | None,
        follower: EventFollower,
        on_delta: Callable[[Delta], None],
        topic: str = "",
    ) -> None:
        self.endpoint, self.replay = endpoint, replay
        self.follower = follower
        self._on_delta = on_delta
        self._ctx = zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self.replays = 0

    async def run(self) -> None:
        """Until cancelled: apply every live message, and replay each gap."""
        try:
            while True:
                _topic, seq, payload = await self._sub.recv_multipart()
                self._emit(self.follower.on_message(ve.parse_seq(seq), payload))
                start = self.follower.replay_from
                if start is not None:  # a gap (or the first message): fill it from the replay
                    self._emit(self.follower.on_replay(await self._replay(start)))
        finally:
            self._sub.close(linger=0)

    def _emit(self, delta: Delta) -> None:
        if delta.added or delta.removed or delta.cleared:
            self._on_delta(delta)

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """Everything the engine still holds from ``start`` on (empty: no replay socket)."""
        if self.replay is None:
            return []
        self.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", ve.seq_bytes(start)))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4 or frames[2] == ve.END_SEQ:
                    return got
                got.append((ve.parse_seq(frames[2]), frames[3]))
        except asyncio.TimeoutError:
            log.warning("replay from %s timed out after %d batches", self.replay, len(got))
            return got
        finally:
            dealer.close(linger=0)
