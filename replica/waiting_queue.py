"""The scheduler's waiting queue: sequences not running, in the order they are admitted."""

from __future__ import annotations

import bisect

from replica.sequence import Sequence, SequenceStatus


class WaitingQueue(list[Sequence]):
    """Waiting sequences sorted by ``key``: arrival (FCFS), or priority then arrival. A plain
    list to read (``running + waiting``, ``len``); ``push`` is the one way in that keeps it
    sorted."""

    def __init__(self, scheduling_policy: str) -> None:
        super().__init__()
        self.by_priority = scheduling_policy == "priority"

    def key(self, seq: Sequence) -> tuple:
        """The order of service; also the preemption order (the largest key goes first)."""
        if self.by_priority:
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def push(self, seq: Sequence) -> None:
        """``seq`` waits (arriving, or preempted) in its place."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self, seq, key=self.key)
