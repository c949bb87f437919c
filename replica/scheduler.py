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

The result is a plain ``SchedulerOutput``; the model runner executes it.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice

from prefixmesh.hashing import extend_block_hashes
from replica.block_manager import BlockManager, HostBlockPool
from replica.config import EngineConfig
from replica.preemption_stats import PreemptionStats
from replica.sequence import Sequence, SequenceStatus
from replica.tenant_share import StepShares, TenantShares


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


class Scheduler:
    """FCFS or priority scheduling over a token budget with chunked prefill and preemption."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        model_id: str,
        host_pool: HostBlockPool | None = None,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.host_pool = host_pool  # None: preemption always recomputes
        self.block_size = block_manager.block_size
        self.model_id = model_id
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []
        # The cacheable prompt block hashes of every sequence added and not finished: blocks
        # this replica will compute or has computed for a queued request (_keep_prefix).
        self.queued_hashes: Counter = Counter()
        self.stats = SchedulerStats()
        self.preempt_stats = PreemptionStats()  # issue 53: preemption and queue-time counters
        self.shares: TenantShares | None = None
        if config.tenant_fairness:
            budget = config.max_num_batched_tokens
            chunk = config.tenant_prefill_chunk or max(self.block_size, budget // 4)
            self.shares = TenantShares(chunk, config.tenant_window_s, burst=budget)

    def _key(self, seq: Sequence) -> tuple:
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    # ------------------------------------------------------------------ queue changes
    def add(self, seq: Sequence) -> None:
        if self.shares is not None:
            self.shares.enter(seq.request.tenant)
        self._keep_prefix(seq, ahead=self.queued_hashes)
        if self.bm.enable_prefix_caching:
            seq.num_queued_hashes = self._cacheable(seq)
            self.queued_hashes.update(seq.block_hashes[: seq.num_queued_hashes])
        self._requeue(seq)

    def _keep_prefix(self, seq: Sequence, ahead: Counter | None = None) -> None:
        """Mark the cached prefix of a sequence that starts to wait (arriving, or preempted by
        recompute) as just used, and keep it while the kept blocks stay within
        ``waiting_prefix_share`` of the pool. The router sent the request here because this
        replica holds that prefix; while the request waits its turn, the running sequences'
        new blocks evict cached blocks, and without this the prefix it came for could be
        among them. The touch alone lasts only until the requests that arrive after it have
        touched theirs: under a long queue the oldest waiting prefix, the one needed next, is
        then the first to go (BlockManager.keep). With ``ahead`` (an arriving sequence: the
        hashes of the requests queued before it) the kept prefix runs on over blocks not cached
        yet that one of those requests will compute, as a burst's later requests wait on its
        first; kept by hash, they are kept once computed and released."""
        if not self.bm.enable_prefix_caching:
            return
        self.update_block_hashes(seq)
        hashes = seq.block_hashes[: self._cacheable(seq)]
        blocks = self.bm.match_prefix(hashes)
        self.bm.touch(blocks)
        self._release_kept(seq)
        n = len(blocks)
        if ahead:
            while n < len(hashes) and hashes[n] in ahead:
                n += 1
        limit = self.config.waiting_prefix_share * self.bm.num_blocks
        if n and self.bm.num_kept_hashes + n <= limit:
            seq.kept_hashes = hashes[:n]
            self.bm.keep(seq.kept_hashes)

    def _release_kept(self, seq: Sequence) -> None:
        """The sequence stops waiting: what it kept is evicted in turn again."""
        if seq.kept_hashes:
            self.bm.unkeep(seq.kept_hashes)
            seq.kept_hashes = []

    def _requeue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.preempt_stats.queued(seq.seq_id)  # issue 53: queue time starts
        bisect.insort(self.waiting, seq, key=self._key)

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
        self.preempt_stats.finished(seq.seq_id)  # issue 53: forget its queue/recompute state
        self._release_kept(seq)
        queued = self.queued_hashes
        for h in seq.block_hashes[: seq.num_queued_hashes]:
            if queued[h] > 1:
                queued[h] -= 1
            else:
                del queued[h]
        seq.num_queued_hashes = 0
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.bm.release(seq.block_table)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        if seq.host_blocks:
            assert self.host_pool is not None
            self.host_pool.release(seq.host_blocks)
            seq.host_blocks = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ prefix cache
    def update_block_hashes(self, seq: Sequence) -> None:
        extend_block_hashes(
            seq.block_hashes, seq.token_ids, self.block_size, self.model_id,
            seq.request.cache_salt,
        )  # fmt: skip

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full of computed tokens in the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        self.update_block_hashes(seq)
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[i - 1] if i else None
            self.bm.cache_block(seq.block_table[i], seq.block_hashes[i], tokens, parent)
        seq.num_hashed_blocks = num_full

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        shares = None if self.shares is None else self.shares.plan(self.running + self.waiting)
        self.running.sort(key=self._key)
        planned: dict[int, ScheduledSeq] = {}  # seq_id -> plan, in batch order
        budget = self.config.max_num_batched_tokens
        deferred: list[Sequence] = []  # prefills of tenants over their share: after the head's
        budget = self._schedule_running(budget, shares, planned, out, deferred)
        # Prompt blocks running sequences are prefilling: a waiting sequence that needs them
        # next sits this step out (its id goes to ``waits``) rather than compute them again.
        wait = self.config.wait_for_inflight_prefix
        inflight = self._inflight_blocks(self.running) if wait else set()
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
                self._preempt(victim, out)
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
                self._preempt(max(idle, key=self._key), out)
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
            if inflight and not seq.host_blocks and self._prefix_in_flight(seq, inflight):
                waits.add(seq.seq_id)
                continue
            if len(self.running) >= self.config.max_num_seqs:
                freed = self._preempt_for(seq, planned, out)
                if freed is None:
                    break
                budget += freed
                continue
            allowed = budget if shares is None else shares.limit(seq, budget)
            if allowed <= 0 or (self.config.batch_invariant and allowed < 3):
                break  # (with 3 tokens of budget, _chunk never gives a waiting prompt 0)
            if seq.host_blocks:
                scheduled = self._swap_in(seq, allowed, out)
            else:
                scheduled = self._admit(seq, allowed)
            if scheduled is None:
                freed = self._preempt_for(seq, planned, out)
                if freed is None:
                    break
                budget += freed
                continue
            self.waiting.remove(seq)
            self.preempt_stats.admitted(seq.seq_id, seq.num_computed_tokens)  # issue 53
            self._release_kept(seq)  # its prefix is referenced now
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            planned[seq.seq_id] = scheduled
            budget -= scheduled.num_new_tokens
            if shares is not None:
                shares.take(seq, scheduled.num_new_tokens)
            if wait:
                inflight |= self._inflight_blocks([seq])
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

    def _inflight_blocks(self, seqs: list[Sequence]) -> set:
        """Hashes of the prompt blocks these running sequences are prefilling and have not
        cached yet (each becomes a prefix-cache entry when its last token is computed)."""
        blocks = set()
        bs = self.block_size
        for seq in seqs:
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue
            self.update_block_hashes(seq)
            blocks.update(seq.block_hashes[seq.num_hashed_blocks : seq.num_prompt_tokens // bs])
        return blocks

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
        inflight = self._inflight_blocks(self.running)
        for seq in self.waiting:
            reused = self._reusable_blocks(seq, inflight) * self.block_size
            total += seq.num_tokens - max(seq.num_computed_tokens, reused)
            total += seq.request.params.max_tokens - seq.num_output_tokens
        return total

    def _reusable_blocks(self, seq: Sequence, inflight: set) -> int:
        """Leading blocks of ``seq`` that are cached or being prefilled by a running sequence."""
        cacheable = self._cacheable(seq)
        if len(seq.block_hashes) < cacheable:
            self.update_block_hashes(seq)
        return self.bm.prefix_length(islice(seq.block_hashes, cacheable), inflight)

    def _prefix_in_flight(self, seq: Sequence, inflight: set) -> bool:
        """Whether ``seq``'s first block past its cached prefix is one a running sequence is
        prefilling: admitted now, it would compute that block (and likely more) again."""
        self.update_block_hashes(seq)
        cacheable = self._cacheable(seq)
        cached = len(self.bm.match_prefix(seq.block_hashes[:cacheable]))
        return cached < cacheable and seq.block_hashes[cached] in inflight

    def _cacheable(self, seq: Sequence) -> int:
        """Leading blocks of ``seq`` a prefix-cache hit may cover. Never the last token: it
        needs logits. In batch-invariant mode not the last two: a lone new token would run in
        the decode attention kernel, whose sums round otherwise than the prefill kernel's
        (docs/fetch.md)."""
        keep = 2 if self.config.batch_invariant else 1
        return max(0, (seq.num_tokens - keep) // self.block_size)

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Reserve prefix-cache hits and new blocks for a waiting sequence, if they fit."""
        bs = self.block_size
        self.update_block_hashes(seq)
        cached = self.bm.match_prefix(seq.block_hashes[: self._cacheable(seq)])
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

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledSeq | None:
        """Bring a swapped-out sequence back: new device blocks, copied in before the forward."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        bs = self.block_size
        extra = max(0, -(-(seq.num_computed_tokens + num_new) // bs) - len(seq.host_blocks))
        if self.bm.num_free_blocks < len(seq.host_blocks) + extra:
            return None
        seq.block_table = [self.bm.allocate() for _ in seq.host_blocks]
        out.swap_in.extend(zip(seq.host_blocks, seq.block_table))
        self.preempt_stats.swapping_in(len(seq.host_blocks))  # issue 53: swap traffic
        out.host_blocks_to_free.extend(seq.host_blocks)  # freed after the copy has run
        seq.host_blocks = []
        seq.block_table.extend(self.bm.allocate() for _ in range(extra))
        seq.num_hashed_blocks = 0  # re-registered (or matched to the cached copy) as they fill
        return ScheduledSeq(seq, num_new)

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

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
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
            self.preempt_stats.swapping_out(len(seq.block_table))  # issue 53: swap traffic
            out.swap_out.extend(zip(seq.block_table, seq.host_blocks))
            self.bm.release(seq.block_table)
            seq.block_table = []
            seq.num_hashed_blocks = 0
            self.stats.swapped_out += 1
        else:
            self._free(seq)
            self.preempt_stats.recomputing(seq.seq_id, seq.num_computed_tokens)  # issue 53
            seq.num_computed_tokens = 0
            self._keep_prefix(seq)  # its full blocks stay cached: keep them for its return
        self.stats.preemptions += 1
        out.preempted.append(seq)
        self._requeue(seq)

    def _preempt_for(
        self, seq: Sequence, planned: dict[int, ScheduledSeq], out: SchedulerOutput
    ) -> int | None:
        """Priority policy: make room for ``seq`` by preempting a lower-priority running one.

        Returns the token budget the preemption freed (the victim may already be planned for
        this step; no forward has run yet, so its plan is simply dropped), or ``None`` when
        there is no lower-priority victim.
        """
        if self.config.scheduling_policy != "priority" or not self.running:
            return None
        victim = max(self.running, key=self._key)
        if self._key(victim) <= self._key(seq):
            return None
        freed = 0
        plan = planned.pop(victim.seq_id, None)
        if plan is not None:
            freed = plan.num_new_tokens
            mine = set(victim.block_table)
            out.copies = [(src, dst) for src, dst in out.copies if dst not in mine]
        self._preempt(victim, out)
        out.preempted.remove(victim)  # a planned priority swap, not a shortage of blocks
        return freed
