"""The scheduler's plain records: one step's plan (what the model runner executes) and the
counters the engine reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: the packed batch in order (decodes first) and KV copies to do first."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), done first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), after copies
    host_blocks_to_free: list[int] = field(default_factory=list)  # once swap_in has run
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class SchedulerStats:
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of which served from the cache
    preemptions: int = 0
    swapped_out: int = 0  # preemptions that swapped to the host pool
    inflight_prefix_waits: int = 0  # steps a waiting sequence sat out for a prefix in flight
