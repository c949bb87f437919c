"""Preemption and swap: what the scheduler does when blocks (or, under the priority policy,
sequence slots) run out.

A preempted sequence either swaps its KV out to the host pool (where the device has memory of
its own and the pool has room) and later back in, or is preempted by recompute: its blocks are
released (full ones stay cached, and its prefix is kept while it waits) and it starts over.
Either way it waits again in its place in the queue.
"""

from __future__ import annotations

from replica.block_manager import BlockManager, HostBlockPool
from replica.config import EngineConfig
from replica.preemption_stats import PreemptionStats
from replica.prefix_tracker import PrefixTracker
from replica.scheduler_output import ScheduledSeq, SchedulerOutput, SchedulerStats
from replica.sequence import Sequence
from replica.waiting_queue import WaitingQueue


class Preemption:
    """Preempts, swaps out and back in, over the scheduler's own queues and counters."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        host_pool: HostBlockPool | None,
        running: list[Sequence],
        waiting: WaitingQueue,
        prefix: PrefixTracker,
        stats: SchedulerStats,
        counters: PreemptionStats,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.host_pool = host_pool  # None: preemption always recomputes
        self.block_size = block_manager.block_size
        self.running = running  # the scheduler's lists, shared (never rebound)
        self.waiting = waiting
        self.prefix = prefix
        self.stats = stats
        self.counters = counters  # by kind, recomputed tokens, swap traffic, queue time

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap the sequence's KV out to the host pool if there is one with room; otherwise
        preempt by recompute: free the blocks (full ones stay cached) and start over later."""
        self.running.remove(seq)
        pool = self.host_pool
        # A block copied-on-write this step holds its content only after the copy runs, which
        # is after swap-outs: such a sequence recomputes instead.
        fresh_copies = {dst for _, dst in out.copies}
        if (
            pool is not None
            and pool.num_free_blocks >= len(seq.block_table) > 0
            and not fresh_copies.intersection(seq.block_table)
        ):
            seq.host_blocks = pool.allocate(len(seq.block_table))
            self.counters.swapping_out(len(seq.block_table))
            out.swap_out.extend(zip(seq.block_table, seq.host_blocks))
            self.bm.release(seq.block_table)
            seq.block_table = []
            seq.num_hashed_blocks = 0
            self.stats.swapped_out += 1
        else:
            self.free(seq)
            self.counters.recomputing(seq.seq_id, seq.num_computed_tokens)
            seq.num_computed_tokens = 0
            self.prefix.keep_prefix(seq)  # its full blocks stay cached: keep them for its return
        self.stats.preemptions += 1
        out.preempted.append(seq)
        self.waiting.push(seq)
        self.counters.queued(seq.seq_id)

    def preempt_for(
        self, seq: Sequence, planned: dict[int, ScheduledSeq], out: SchedulerOutput
    ) -> int | None:
        """Priority policy: make room for ``seq`` by preempting a lower-priority running one.

        Returns the token budget the preemption freed (the victim may already be planned for
        this step; no forward has run yet, so its plan is simply dropped), or ``None`` when
        there is no lower-priority victim.
        """
        if self.config.scheduling_policy != "priority" or not self.running:
            return None
        victim = max(self.running, key=self.waiting.key)
        if self.waiting.key(victim) <= self.waiting.key(seq):
            return None
        freed = 0
        plan = planned.pop(victim.seq_id, None)
        if plan is not None:
            freed = plan.num_new_tokens
            mine = set(victim.block_table)
            out.copies = [(src, dst) for src, dst in out.copies if dst not in mine]
        self.preempt(victim, out)
        out.preempted.remove(victim)  # a planned priority swap, not a shortage of blocks
        return freed

    def swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledSeq | None:
        """Bring a swapped-out sequence back: new device blocks, copied in before the forward."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        bs = self.block_size
        extra = max(0, -(-(seq.num_computed_tokens + num_new) // bs) - len(seq.host_blocks))
        if self.bm.num_free_blocks < len(seq.host_blocks) + extra:
            return None
        seq.block_table = [self.bm.allocate() for _ in seq.host_blocks]
        out.swap_in.extend(zip(seq.host_blocks, seq.block_table))
        self.counters.swapping_in(len(seq.host_blocks))
        out.host_blocks_to_free.extend(seq.host_blocks)  # freed after the copy has run
        seq.host_blocks = []
        seq.block_table.extend(self.bm.allocate() for _ in range(extra))
        seq.num_hashed_blocks = 0  # re-registered (or matched to the cached copy) as they fill
        return ScheduledSeq(seq, num_new)

    def free(self, seq: Sequence) -> None:
        self.bm.release(seq.block_table)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        if seq.host_blocks:
            assert self.host_pool is not None
            self.host_pool.release(seq.host_blocks)
            seq.host_blocks = []
