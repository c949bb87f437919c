"""Counters of what preemption and queueing cost a replica: ``PreemptionStats``.

A preempted sequence either swaps its KV blocks out to the host pool (and back in later) or
drops them and recomputes: the tokens it computed again are the price of that preemption, less
what the prefix cache gave back when it was admitted again (its full blocks stay cached until
evicted). Queue time is how long sequences waited to be admitted, on arrival and after each
recompute or swap preemption. The scheduler calls the hooks below from a handful of lines in its
preempt, swap-in and admission paths; the engine snapshots ``counts()`` for ReplicaStats,
Prometheus and ``prefixmesh top``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PreemptionCounts:
    """A cumulative snapshot (counters only grow)."""

    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    recomputed_tokens: int = 0  # tokens computed a second time because of a recompute preemption
    swapped_out_blocks: int = 0  # KV blocks copied device -> host
    swapped_in_blocks: int = 0  # KV blocks copied host -> device
    queue_time_s: float = 0.0  # summed over every admission
    admissions: int = 0  # admissions (first ones and after preemption) summed in queue_time_s

    @property
    def preemptions(self) -> int:
        return self.recompute_preemptions + self.swap_preemptions


@dataclass(slots=True)
class PreemptionStats:
    """The scheduler's live counters, with the per-sequence state they need."""

    clock: object = time.monotonic  # a callable returning seconds; tests pass a fake one
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    queue_time_s: float = 0.0
    admissions: int = 0
    _waiting_since: dict[int, float] = field(default_factory=dict)  # seq_id -> when it queued
    _lost_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> computed tokens dropped

    def queued(self, seq_id: int) -> None:
        """The sequence starts to wait (it arrived, or was preempted)."""
        self._waiting_since[seq_id] = self.clock()  # type: ignore[operator]

    def admitted(self, seq_id: int, num_computed_tokens: int) -> None:
        """The sequence left the waiting queue with ``num_computed_tokens`` already computed (its
        cached prefix, or what it swapped back in)."""
        since = self._waiting_since.pop(seq_id, None)
        if since is not None:
            self.queue_time_s += self.clock() - since  # type: ignore[operator]
            self.admissions += 1
        lost = self._lost_tokens.pop(seq_id, None)
        if lost is not None:
            self.recomputed_tokens += max(0, lost - num_computed_tokens)

    def recomputing(self, seq_id: int, num_computed_tokens: int) -> None:
        """A recompute preemption dropped ``num_computed_tokens`` of computed KV."""
        self.recompute_preemptions += 1
        self._lost_tokens[seq_id] = self._lost_tokens.get(seq_id, 0) + num_computed_tokens

    def swapping_out(self, num_blocks: int) -> None:
        self.swap_preemptions += 1
        self.swapped_out_blocks += num_blocks

    def swapping_in(self, num_blocks: int) -> None:
        self.swapped_in_blocks += num_blocks

    def finished(self, seq_id: int) -> None:
        """The sequence left for good (finished or aborted, waiting or not): forget it."""
        self._waiting_since.pop(seq_id, None)
        self._lost_tokens.pop(seq_id, None)

    def counts(self) -> PreemptionCounts:
        return PreemptionCounts(
            self.recompute_preemptions, self.swap_preemptions, self.recomputed_tokens,
            self.swapped_out_blocks, self.swapped_in_blocks, self.queue_time_s, self.admissions,
        )  # fmt: skip

    @property
    def tracked(self) -> int:
        """Sequences with per-sequence state (0 once every sequence has finished)."""
        return len(self._waiting_since.keys() | self._lost_tokens.keys())
