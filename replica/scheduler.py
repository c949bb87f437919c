"""The step scheduler: which sequences run this step, and how many new tokens each.

Every step is rebuilt from scratch (continuous batching). Running sequences go first (decodes
and unfinished prefill chunks), so a long prompt never stalls streams that are already decoding;
then waiting sequences are admitted while the token budget, ``max_num_seqs`` and the KV pool
allow. A waiting sequence reuses the longest run of cached leading blocks (never its last token,
which needs logits); one whose next uncached blocks a running sequence is prefilling right now
(a burst of requests sharing a prompt prefix) waits until they are cached, instead of computing
the same blocks a second time, while the sequences behind it go ahead. When blocks run out, the
lowest-priority, newest running sequence is
preempted: by recompute (its blocks are released, full ones stay cached, and it waits again) or,
where the device has memory of its own, by swapping its blocks out to a host pool and back in.
With several tenants present, ``TenantShares`` (replica/tenant_share.py) orders admission by
the tokens each tenant has been served and caps the prefill of tenants over their share.

The result is a plain ``SchedulerOutput`` (replica/scheduler_output.py); the model runner
executes it. The waiting queue, preemption and swap, and the prefix-cache bookkeeping are
replica/waiting_queue.py, replica/preemption.py and replica/prefix_tracker.py.
"""

from __future__ import annotations

from replica.block_manager import BlockManager, HostBlockPool
from replica.config import EngineConfig
from replica.preemption import Preemption
from replica.preemption_stats import PreemptionStats
from replica.prefix_tracker import PrefixTracker
from replica.scheduler_output import ScheduledSeq, SchedulerOutput, SchedulerStats
from replica.sequence import Sequence, SequenceStatus
from replica.tenant_share import StepShares, TenantShares
from replica.waiting_queue import WaitingQueue

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput", "SchedulerStats"]


class Scheduler:
    """FCFS or priority scheduling over a token budget with chunked prefill and preemption:
    admission and chunking here; the waiting queue, preemption with swap and the prefix-cache
    bookkeeping are its parts (``waiting``, ``preemption``, ``prefix``)."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        model_id: str,
        host_pool: HostBlockPool | None = None,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.waiting = WaitingQueue(config.scheduling_policy)  # replica/waiting_queue.py
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        # Prefix-cache bookkeeping (replica/prefix_tracker.py) and preemption with swap
        # (replica/preemption.py), over the same queues and counters.
        self.prefix = PrefixTracker(config, block_manager, model_id)
        self.preempt_stats = PreemptionStats()  # preemptions, recomputed tokens, queue time
        self.preemption = Preemption(
            config,
            block_manager,
            host_pool,
            self.running,
            self.waiting,
            self.prefix,
            self.stats,
            self.preempt_stats,
        )
        self.shares: TenantShares | None = None
        if config.tenant_fairness:
            budget = config.max_num_batched_tokens
            chunk = config.tenant_prefill_chunk or max(self.block_size, budget // 4)
            self.shares = TenantShares(chunk, config.tenant_window_s, burst=budget)

    # ------------------------------------------------------------------ queue changes
    def add(self, seq: Sequence) -> None:
        if self.shares is not None:
            self.shares.enter(seq.request.tenant)
        self.prefix.enqueue(seq)
        self.waiting.push(seq)
        self.preempt_stats.queued(seq.seq_id)  # its queue time starts

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (parallel sampling)."""
        if self.shares is not None:
            self.shares.enter(seq.request.tenant)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence from the queues and free its blocks at once."""
        queue = {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting}
        if seq.status in queue:
            queue[seq.status].remove(seq)
            if self.shares is not None:
                self.shares.leave(seq.request.tenant)
        seq.status = SequenceStatus.FINISHED
        self.preempt_stats.finished(seq.seq_id)  # forget its queue/recompute state
        self.prefix.forget(seq)
        self.preemption.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        shares = None if self.shares is None else self.shares.plan(self.running + self.waiting)
        self.running.sort(key=self.waiting.key)
        planned: dict[int, ScheduledSeq] = {}  # seq_id -> plan, in batch order
        budget = self.config.max_num_batched_tokens
        deferred: list[Sequence] = []  # prefills of tenants over their share: after the head's
        budget = self._schedule_running(budget, shares, planned, out, deferred)
        # Prompt blocks running sequences are prefilling: a waiting sequence that needs them
        # next sits this step out (its id goes to ``waits``) rather than compute them again.
        wait = self.config.wait_for_inflight_prefix
        inflight = self.prefix.inflight_blocks(self.running) if wait else set()
        waits: set[int] = set()
        # Admit waiting sequences only when no running one had to be preempted this step.
        if shares is None:
            self._admit_waiting(budget, None, planned, out, inflight, waits)
        else:
            budget = self._admit_waiting(
                budget, shares, planned, out, inflight, waits, head_only=True
            )
            budget = self._schedule_deferred(budget, shares, planned, out, deferred)
            self._admit_waiting(budget, shares, planned, out, inflight, waits)
        self.stats.inflight_prefix_waits += len(waits)

        plans = list(planned.values())
        if self.shares is not None:
            for p in plans:
                self.shares.charge(p.seq.request.tenant, p.num_new_tokens)
        # Decodes first, contiguous: the attention backend batches them in one call.
        out.scheduled = [p for p in plans if p.num_new_tokens == 1 and not p.seq.is_prefill]
        out.scheduled += [p for p in plans if p.num_new_tokens > 1 or p.seq.is_prefill]
        return out

    def _schedule_running(
        self,
        budget: int,
        shares: StepShares | None,
        planned: dict[int, ScheduledSeq],
        out: SchedulerOutput,
        deferred: list[Sequence],
    ) -> int:
        """Plan running sequences in order, preempting the newest when blocks run out (with
        tenant shares, prefills of tenants over their share go to ``deferred`` instead);
        returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if shares is not None and shares.defers(seq):
                deferred.append(seq)
                i += 1
                continue
            num_new = self._chunk(seq, seq.num_computed_tokens, budget)
            if num_new == 0:  # batch-invariant mode: no lone prompt token (_chunk)
                i += 1
                continue
            while not self._reserve(seq, num_new, out):
                victim = self.running[-1]
                self.preemption.preempt(victim, out)
                if victim is seq:
                    break
            else:
                planned[seq.seq_id] = ScheduledSeq(seq, num_new)
                budget -= num_new
                if shares is not None:
                    shares.take(seq, num_new)
                i += 1
            # else ``seq`` preempted itself; the next running sequence now sits at index i.
        return budget

    def _schedule_deferred(
        self,
        budget: int,
        shares: StepShares,
        planned: dict[int, ScheduledSeq],
        out: SchedulerOutput,
        deferred: list[Sequence],
    ) -> int:
        """Running prefills of tenants over their share, oldest first, within what the shares
        allow; when blocks run out, the newest running sequence not planned yet is preempted
        (as in ``_schedule_running``, so the oldest always makes progress)."""
        for seq in deferred:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted since
            num_new = self._chunk(seq, seq.num_computed_tokens, shares.limit(seq, budget))
            if num_new <= 0:
                continue
            while not self._reserve(seq, num_new, out):
                idle = [s for s in self.running if s.seq_id not in planned and s is not seq]
                if not idle:
                    break
                self.preemption.preempt(max(idle, key=self.waiting.key), out)
            else:
                planned[seq.seq_id] = ScheduledSeq(seq, num_new)
                budget -= num_new
                shares.take(seq, num_new)
        return budget

    def _admit_waiting(
        self,
        budget: int,
        shares: StepShares | None,
        planned: dict[int, ScheduledSeq],
        out: SchedulerOutput,
        inflight: set,
        waits: set[int],
        head_only: bool = False,
    ) -> int:
        """Admit waiting sequences while budget, ``max_num_seqs`` and blocks allow (with the
        priority policy, by preempting lower-priority running ones); returns the budget left.
        A sequence whose next prompt block is in ``inflight`` joins ``waits`` instead, and each
        admitted prefill adds its own blocks to ``inflight``."""
        wait = self.config.wait_for_inflight_prefix
        while self.waiting and not out.preempted:
            seq = self._next_waiting(shares, head_only, waits)
            if seq is None:
                break
            if inflight and not seq.host_blocks and self.prefix.prefix_in_flight(seq, inflight):
                waits.add(seq.seq_id)
                continue
            if len(self.running) >= self.config.max_num_seqs:
                freed = self.preemption.preempt_for(seq, planned, out)
                if freed is None:
                    break
                budget += freed
                continue
            allowed = budget if shares is None else shares.limit(seq, budget)
            if allowed <= 0 or (self.config.batch_invariant and allowed < 3):
                break  # (with 3 tokens of budget, _chunk never gives a waiting prompt 0)
            if seq.host_blocks:
                scheduled = self.preemption.swap_in(seq, allowed, out)
            else:
                scheduled = self._admit(seq, allowed)
            if scheduled is None:
                freed = self.preemption.preempt_for(seq, planned, out)
                if freed is None:
                    break
                budget += freed
                continue
            self.waiting.remove(seq)
            self.preempt_stats.admitted(seq.seq_id, seq.num_computed_tokens)
            self.prefix.release_kept(seq)  # its prefix is referenced now
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            planned[seq.seq_id] = scheduled
            budget -= scheduled.num_new_tokens
            if shares is not None:
                shares.take(seq, scheduled.num_new_tokens)
            if wait:
                inflight |= self.prefix.inflight_blocks([seq])
        return budget

    def _next_waiting(
        self, shares: StepShares | None, head_only: bool, waits: set[int]
    ) -> Sequence | None:
        """The waiting sequence to admit next, passing over those in ``waits``: the queue's
        head, or with tenant shares the first (by priority, then by tenant least served, then
        by arrival) whose tenant may still prefill this step (``head_only``: of the head
        tenant)."""
        if shares is None:
            return next((seq for seq in self.waiting if seq.seq_id not in waits), None)
        best, best_key = None, None
        for seq in self.waiting:  # sorted by _key: the first of each tenant is its best
            if seq.seq_id in waits:
                continue
            if (head_only and seq.request.tenant != shares.head) or shares.limit(seq, 1) <= 0:
                continue
            key = (seq.priority if self.config.scheduling_policy == "priority" else 0,
                   shares.order(seq))  # fmt: skip
            if best_key is None or key < best_key:
                best, best_key = seq, key
        return best

    def outstanding_tokens(self) -> int:
        """Tokens still to compute over every queued sequence: prompt tokens to prefill plus
        tokens to decode. A waiting sequence's leading blocks that are cached, or that a
        running sequence is prefilling now, are left out: once admitted it reuses them.
        Routers read this as the replica's load; counted whole, a burst of requests waiting
        on the prefix their first request is prefilling would look like a queue of whole
        prompts, and push the rest of the burst off its warm replica."""
        total = 0
        for seq in self.running:
            total += seq.num_tokens - seq.num_computed_tokens
            total += seq.request.params.max_tokens - seq.num_output_tokens
        if not self.waiting:
            return total
        inflight = self.prefix.inflight_blocks(self.running)
        for seq in self.waiting:
            reused = self.prefix.reusable_blocks(seq, inflight) * self.block_size
            total += seq.num_tokens - max(seq.num_computed_tokens, reused)
            total += seq.request.params.max_tokens - seq.num_output_tokens
        return total

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Reserve prefix-cache hits and new blocks for a waiting sequence, if they fit."""
        bs = self.block_size
        self.prefix.update_block_hashes(seq)
        cached = self.bm.match_prefix(seq.block_hashes[: self.prefix.cacheable(seq)])
        num_computed = len(cached) * bs
        num_new = seq.num_tokens - num_computed
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = self._chunk(seq, num_computed, budget)
        needed = -(-(num_computed + num_new) // bs) - len(cached)
        if self.bm.num_free_blocks - self.bm.num_blocks_to_take(cached) < needed:
            return None
        self.bm.reference(cached)
        seq.block_table = list(cached)
        seq.num_hashed_blocks = len(cached)
        seq.block_table.extend(self.bm.allocate() for _ in range(needed))
        seq.num_computed_tokens = num_computed
        self.stats.prefix_cache_queries += seq.num_tokens
        self.stats.prefix_cache_hits += num_computed
        if seq.request.num_cached_tokens < 0:
            seq.request.num_cached_tokens = num_computed
        return ScheduledSeq(seq, num_new)

    def _chunk(self, seq: Sequence, num_computed: int, budget: int) -> int:
        """Tokens of ``seq`` to compute this step, from ``num_computed`` on, within ``budget``.

        In batch-invariant mode a prompt never runs one token at a time while more of it is
        left (a chunk of one, or one leaving one behind): a step of one new token takes the
        decode attention kernel, whose sums round otherwise than the prefill kernel's, so the
        token's KV would depend on how the prompt was chunked. 0: nothing this step."""
        left = seq.num_tokens - num_computed
        num_new = min(left, budget)
        if not self.config.batch_invariant or left < 2 or num_new == left:
            return num_new
        if left - num_new == 1:
            num_new -= 1
        return num_new if num_new >= 2 else 0

    def _reserve(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Make ``seq``'s block table cover its next ``num_new`` tokens (copy-on-write too)."""
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        needed = -(-(seq.num_computed_tokens + num_new) // bs) - len(seq.block_table)
        shared_tail = (
            first < len(seq.block_table) and self.bm.ref_counts[seq.block_table[first]] > 1
        )
        if self.bm.num_free_blocks < needed + int(shared_tail):
            return False
        if shared_tail:
            # Samples forked from one prompt share its last partial block; the first to write
            # into it gets its own copy.
            src = seq.block_table[first]
            dst = self.bm.allocate()
            self.bm.release([src])
            seq.block_table[first] = dst
            out.copies.append((src, dst))
        seq.block_table.extend(self.bm.allocate() for _ in range(max(needed, 0)))
        return True
