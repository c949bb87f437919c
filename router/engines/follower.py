"""Follows one engine's numbered event stream and keeps its view exact, in sequence order.

Every ZMQ message carries the publisher's sequence number. Applying messages strictly in that
order is what keeps the view exact, and is how we avoid the bug llm-d hit (a ``BlockStored``
applied after the ``BlockRemoved`` that followed it left a block the engine no longer held):

- a message ahead of the next expected number is held back (``_pending``), never applied early,
  and a replay from the expected number is asked for;
- a message behind it (a duplicate, or a replay overlapping the live stream) is dropped;
- a replay that fills the gap is applied, then whatever was held back, in order;
- a replay that cannot fill it (the engine's buffer moved on, or no replay socket) ends in a
  *cleared view*: what we knew is dropped and the view is rebuilt from the next messages on.

The very first message is a gap too (from 0): a replay from 0 rebuilds an engine that was
already running, otherwise its view starts cleared. All of it is synchronous and socket-free so
that recorded and doctored streams can be replayed in tests; ``router/engines/subscriber.py``
drives it from the sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prefixmesh.vllm_events import EventFormatError, decode_batch
from router.engines.translate import Delta, EngineCacheView

log = logging.getLogger(__name__)

MAX_PENDING = 10_000  # held-back messages; beyond this the gap is given up on


class EventFollower:
    """The sequence state machine of one engine; ``view`` is its cache in our hashes."""

    def __init__(self, view: EngineCacheView) -> None:
        self.view = view
        self.next_seq: int | None = None  # None: nothing applied yet
        self._pending: dict[int, bytes] = {}
        self.gaps = 0
        self.clears = 0
        self.dropped = 0
        self.bad = 0

    @property
    def replay_from(self) -> int | None:
        """The sequence number a replay should start at, or None when nothing is missing."""
        if not self._pending:
            return None
        return 0 if self.next_seq is None else self.next_seq

    def on_message(self, seq: int, payload: bytes) -> Delta:
        """A live message; returns the changes it (and held-back ones it releases) made."""
        delta = Delta()
        if self.next_seq is not None and seq < self.next_seq:
            self.dropped += 1
            return delta
        if self.next_seq is None or seq > self.next_seq:
            if not self._pending:
                self.gaps += 1
            self._pending[seq] = payload
            if len(self._pending) > MAX_PENDING:
                return self.give_up()
            return delta
        self._apply(payload, delta)
        self.next_seq = seq + 1
        return self._release(delta)

    def on_replay(self, messages: Iterable[tuple[int, bytes]]) -> Delta:
        """The replay's messages (in any order); clears the view if they cannot fill the gap."""
        start = self.replay_from
        if start is None:
            return Delta()
        replayed = dict(messages)
        if self.next_seq is None and replayed and 0 not in replayed:
            return self.give_up()
        delta = Delta()
        self._pending.update(replayed)
        if self.next_seq is None:
            self.next_seq = 0
        self._release(delta)
        if self._pending:  # the replay did not reach the held-back messages
            return self.give_up(delta)
        return delta

    def give_up(self, delta: Delta | None = None) -> Delta:
        """The gap cannot be filled: clear the view, go on from the oldest held-back message."""
        delta = delta or Delta()
        self.clears += 1
        self.view.clear()
        delta.added.clear()
        delta.removed.clear()
        delta.cleared = True
        if self._pending:
            self.next_seq = min(self._pending)
        log.warning("engine event gap not filled: view cleared, rebuilding from seq %s",
                    self.next_seq)  # fmt: skip
        return self._release(delta)

    def _release(self, delta: Delta) -> Delta:
        while self.next_seq in self._pending:
            self._apply(self._pending.pop(self.next_seq), delta)
            self.next_seq += 1
        # Messages below the new next_seq were superseded by what was applied.
        for seq in [s for s in self._pending if s < self.next_seq]:
            del self._pending[seq]
        return delta

    def _apply(self, payload: bytes, delta: Delta) -> None:
        try:
            batch = decode_batch(payload)
        except EventFormatError as exc:
            # A lost batch: the view can no longer be trusted.
            self.bad += 1
            log.warning("undecodable KV event batch: view cleared (%s)", exc)
            self.view.clear()
            delta.added.clear()
            delta.removed.clear()
            delta.cleared = True
            return
        self.view.apply(batch.events, delta)
