"""The replica engine: requests in, one scheduled forward per ``step()``, token deltas out.

``LLM`` (offline) and the gRPC server drive the same ``LLMEngine``. One step: the scheduler
picks running decodes plus prefill chunks within the token budget, the model runner does one
forward over the packed batch, the sampler picks tokens, the output processor detokenizes and
checks stop conditions, and finished sequences free their blocks at once.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from kernels.cpu_flags import cpu_flags
from prefixmesh.hashing import BlockHash, block_hashes
from prefixmesh.tokenizer import Tokenizer
from replica.allocator import keep_freed_memory
from replica.block_manager import BlockManager, HostBlockPool, NoFreeBlocksError
from replica.config import EngineConfig
from replica.engine_request import EngineRequest
from replica.fetch.transfer import FetchedBlocks, PinnedBlocks, chained_prefix
from replica.loader import load_model_config, load_state_dict, resolve_model
from replica.model_runner import DTYPES, ModelRunner, kv_bytes_per_block
from replica.output_processor import OutputProcessor
from replica.outputs import StepOutput
from replica.preemption_stats import PreemptionCounts
from replica.sampler import Sampler
from replica.scheduler import Scheduler
from replica.sequence import Request, Sequence

KVEventCallback = Callable[[list[BlockHash], list[BlockHash]], None]


@dataclass(slots=True)
class EngineStats:
    """A snapshot for metrics, load reports and the router."""

    running: int
    waiting: int
    kv_usage: float
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    queued_tokens: int
    kept_hashes: int  # prefix blocks waiting requests keep (BlockManager.keep)
    kept_evictions: int  # kept blocks evicted all the same: nothing else was left
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    swapped_out: int
    prompt_tokens: int
    generation_tokens: int
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    preempt: PreemptionCounts = field(default_factory=PreemptionCounts)  # and queue time


def default_dtype(device: str) -> str:
    """What ``dtype="auto"`` means on ``device``.

    bfloat16 on CUDA, and on a CPU that computes it natively (AVX-512 BF16 or AMX), where it is
    several times faster than float32 end to end (docs/benchmarks.md). A CPU without those
    (AVX2 only) emulates bfloat16 matmuls about 4-5x slower than float32, so it gets float32.
    """
    if device.startswith("cuda") or cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AVX-512 BF16 or AMX-BF16 (Linux /proc/cpuinfo flags)."""
    flags = cpu_flags(cpuinfo)
    if flags is None:  # no cpuinfo (macOS, Windows): trust oneDNN's own check
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


class LLMEngine:
    """One model replica's engine. Not thread-safe: one thread owns it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        files = resolve_model(config.model)
        self.model_id = files.model_id
        self.model_config = load_model_config(files.path)
        self.tokenizer = Tokenizer.from_dir(files.path)
        dtype_name = default_dtype(config.device) if config.dtype == "auto" else config.dtype
        self.dtype = DTYPES[dtype_name]
        self.block_size = config.block_size
        mc = self.model_config
        limit = mc.max_position_embeddings
        if mc.sliding_window:
            limit = min(limit, mc.sliding_window)  # beyond the window we would need masking
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len must be <= {limit} for this model")
        self.max_model_len = config.max_model_len or limit
        num_blocks = config.num_kv_blocks or max(
            2,
            int(config.kv_cache_memory_gb * 2**30)
            // kv_bytes_per_block(mc, self.block_size, self.dtype),
        )
        # A sequence can never outgrow the whole KV pool: past it, preemption could only
        # recompute it forever. Cap the context there (it finishes with "length").
        self.max_model_len = min(self.max_model_len, num_blocks * self.block_size)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | self.tokenizer.eos_token_ids
        device = torch.device(config.device)
        if device.type == "cpu":
            keep_freed_memory()  # activations reuse warm heap memory (replica/allocator.py)
        swap = config.preemption_mode == "swap" or (
            config.preemption_mode == "auto" and device.type == "cuda"
        )
        num_host_blocks = 0
        if swap:
            num_host_blocks = config.num_host_blocks or max(
                1,
                int(config.swap_space_gb * 2**30)
                // kv_bytes_per_block(mc, self.block_size, self.dtype),
            )
        self.runner = ModelRunner(
            mc,
            load_state_dict(files.path, self.dtype),
            self.dtype,
            device,
            num_blocks,
            self.block_size,
            self.max_model_len,
            config.attention_backend,
            num_host_blocks,
            config.batch_invariant,
        )
        self._stored: list[BlockHash] = []
        self._removed: list[BlockHash] = []
        self.block_manager = BlockManager(
            num_blocks, self.block_size, config.enable_prefix_caching,
            on_stored=self._stored.append, on_removed=self._removed.append,
            eviction=config.eviction,
        )  # fmt: skip
        self.host_pool = HostBlockPool(num_host_blocks) if num_host_blocks else None
        self.scheduler = Scheduler(config, self.block_manager, self.model_id, self.host_pool)
        self.sampler = Sampler(seed=config.seed)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._kv_event_callback: KVEventCallback | None = None
        self._requests: dict[str, Request] = {}
        self._pending: list[StepOutput] = []  # aborted requests' final outputs
        self._newly_scheduled: list[str] = []  # requests that got compute for the first time
        self._seq_ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished_by_reason: dict[str, int] = {}
        self._pins: dict[int, list[int]] = {}  # blocks held for transfers to peers
        self._pin_ids = itertools.count()
        # Wraps each step's model forward. The server's engine thread sets it to release the
        # lock it holds on the engine's bookkeeping, so short calls on the block pool (a peer
        # pinning blocks, fetched blocks going in) run during the forward instead of waiting
        # out the step (EngineLoop.call_now).
        self.during_forward: Callable[[], AbstractContextManager[object]] = nullcontext

    # ------------------------------------------------------------------ requests
    def add(self, request: EngineRequest) -> None:
        """Queue one request, the only way in (the server and ``LLM`` both build the record);
        raises ``ValueError`` naming the bad field. The engine keeps the record: do not reuse it.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        params = request.params
        params.validate()
        token_ids = self._prompt_token_ids(request.prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, longer than the model's context "
                f"(max_model_len={self.max_model_len}, which includes at least one output token)"
            )
        if request.unsent_text and params.n != 1:
            raise ValueError(f"unsent_text needs n == 1 (got n={params.n})")
        arrival = request.arrival_time
        record = Request(request, token_ids, time.monotonic() if arrival is None else arrival)
        seq = self._new_sequence(record, 0, list(token_ids), len(token_ids))
        if request.block_hashes:
            assert len(request.block_hashes) <= len(token_ids) // self.block_size
            seq.block_hashes = list(request.block_hashes)  # hashed once, by the server
        self._requests[request.request_id] = record
        self._prompt_tokens += len(token_ids)
        self.scheduler.add(seq)

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids must be in [0, {vocab}) (got {bad[0]!r})")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        return token_ids

    def prompt_block_hashes(self, token_ids: list[int], cache_salt: str) -> list[BlockHash]:
        """The chained hashes of the prompt's full blocks, as this engine's prefix cache keys
        them; a caller that needs them before ``add`` passes them on in the record."""
        return block_hashes(token_ids, self.block_size, self.model_id, cache_salt)

    def cached_prefix_blocks(self, hashes: list[BlockHash]) -> int:
        """How many of these leading blocks the prefix cache holds (0 with caching off). Safe
        from another thread: a stale answer only changes a fetch decision, and the dict reads
        it makes are atomic under the GIL."""
        if not self.block_manager.enable_prefix_caching:
            return 0
        return len(self.block_manager.match_prefix(hashes))

    def _new_sequence(
        self, request: Request, index: int, token_ids: list[int], num_prompt: int
    ) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, token_ids, num_prompt)
        seq.state = self.output.new_state(seq)
        request.sequences.append(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its final outputs come with the next step."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        aborted = 0
        for seq in request.sequences:
            if not seq.finished:
                self.scheduler.finish(seq)
                self._pending.append(self.output.finish(seq, "abort"))
                aborted += 1
        for index in range(len(request.sequences), request.params.n):
            self._pending.append(self.output.abort_unstarted(request, index))
            aborted += 1
        self._count_finished("abort", aborted)
        self._flush_kv_events()

    def abort_all(self) -> None:
        """Abort every request (after a failure), freeing all their blocks."""
        for request_id in list(self._requests):
            self.abort_request(request_id)

    def pop_newly_scheduled(self) -> list[str]:
        """Request ids that got compute for the first time since the last call (queue time
        ends there)."""
        ids, self._newly_scheduled = self._newly_scheduled, []
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        """Run one scheduled forward; return the token deltas it produced."""
        outputs, self._pending = self._pending, []
        if not self.scheduler.has_work():
            return outputs
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            # Nothing fits this step, but KV moves the scheduler decided on must still happen.
            self.runner.swap_out(sched.swap_out)
            self._flush_kv_events()
            return outputs
        for item in sched.scheduled:
            request = item.seq.request
            if not request.scheduled:
                request.scheduled = True
                self._newly_scheduled.append(request.request_id)
        # The blocks scheduling evicted, reported now: a router stops counting on them while
        # the forward runs (a prefill step can take a second), and the report stays apart from
        # the blocks this step stores, which may include the same hashes computed again.
        self._flush_kv_events()
        with self.during_forward():  # reads block tables only: the pool may change meanwhile
            logits, sample_idx = self.runner.execute(sched)
        if sched.host_blocks_to_free:
            assert self.host_pool is not None
            self.host_pool.release(sched.host_blocks_to_free)
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.scheduler.prefix.cache_computed_blocks(item.seq)

        seqs: list[Sequence] = []
        rows: list[int] = []
        for j, i in enumerate(sample_idx):
            seq = sched.scheduled[i].seq
            request = seq.request
            if request.params.n > 1 and not request.forked:
                for child in self._fork(seq):
                    seqs.append(child)
                    rows.append(j)
            seqs.append(seq)
            rows.append(j)
        if rows != list(range(len(sample_idx))):
            logits = logits[torch.tensor(rows)]
        results = self.sampler.sample(logits, [self.output.sampling_row(s) for s in seqs])
        for seq, result in zip(seqs, results):
            out = self.output.append_token(seq, result.token_id, result.logprobs)
            self._generation_tokens += 1
            if out.finished:
                self.scheduler.finish(seq)
                self._count_finished(out.finish_reason, 1)
                if seq.request.finished:
                    self._requests.pop(seq.request.request_id, None)
            outputs.append(out)
        self._flush_kv_events()
        return outputs

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: n - 1 more samples sharing the prompt's blocks (copy on write)."""
        request = parent.request
        request.forked = True
        children = []
        for index in range(1, request.params.n):
            child = self._new_sequence(
                request, index, list(parent.token_ids), parent.num_prompt_tokens
            )
            child.block_table = list(parent.block_table)
            self.block_manager.reference(child.block_table)
            child.block_hashes = list(parent.block_hashes)
            child.num_hashed_blocks = parent.num_hashed_blocks
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _count_finished(self, reason: str | None, count: int) -> None:
        if reason and count > 0:
            self._finished_by_reason[reason] = self._finished_by_reason.get(reason, 0) + count

    # ------------------------------------------------------------------ KV events
    def set_kv_event_callback(self, callback: KVEventCallback | None) -> None:
        """``callback(stored, removed)`` gets the block hashes entering and leaving the cache."""
        self._kv_event_callback = callback

    def _flush_kv_events(self) -> None:
        if not (self._stored or self._removed):
            return
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        if self._kv_event_callback is not None:
            self._kv_event_callback(stored, removed)

    def cached_block_hashes(self) -> set[BlockHash]:
        return self.block_manager.cached_hashes()

    def reset_prefix_cache(self) -> int:
        dropped = self.block_manager.reset_prefix_cache()
        self._flush_kv_events()
        return dropped

    # ------------------------------------------------------------------ KV transfer
    def pin_prefix(self, hashes: list[BlockHash], cache_salt: str, start: int = 0) -> PinnedBlocks:
        """Reference the leading blocks of ``hashes`` held here whose tokens chain to them
        from ``cache_salt``'s root, from block ``start`` on, so they stay put while a peer
        reads them (none when the chain breaks before ``start``)."""
        bm = self.block_manager
        blocks = bm.match_prefix(hashes)
        tokens = [bm.block_tokens[b] for b in blocks]
        n = chained_prefix(hashes[: len(blocks)], tokens, self.model_id, cache_salt)
        start = min(max(start, 0), n)
        blocks = blocks[start:n]
        bm.reference(blocks)
        pin_id = next(self._pin_ids)
        self._pins[pin_id] = blocks
        token_ids = [t for t in tokens[start:n] if t is not None]
        return PinnedBlocks(pin_id, blocks, list(hashes[start:n]), token_ids)

    def pin_chains(self, wanted: list[BlockHash], cache_salt: str, limit: int) -> PinnedBlocks:
        """Reference, for a peer's warm start, the whole chain of each ``wanted`` block held
        here whose tokens chain to it from ``cache_salt``'s root, parents first, each block
        once, at most ``limit`` blocks."""
        bm = self.block_manager
        chosen: dict[BlockHash, int] = {}  # in insertion order: parents before children
        for h in wanted:
            if len(chosen) >= limit or h in chosen:
                continue
            blocks = bm.chain(h)
            hashes = [bm.block_hash[b] for b in blocks]
            tokens = [bm.block_tokens[b] for b in blocks]
            if not blocks or chained_prefix(hashes, tokens, self.model_id, cache_salt) < len(
                blocks
            ):
                continue
            for b, bh in zip(blocks, hashes):
                if bh is not None and bh not in chosen and len(chosen) < limit:
                    chosen[bh] = b
        blocks = list(chosen.values())
        bm.reference(blocks)
        pin_id = next(self._pin_ids)
        self._pins[pin_id] = blocks
        return PinnedBlocks(
            pin_id,
            blocks,
            list(chosen),
            [bm.block_tokens[b] or () for b in blocks],
            [bm.block_parent[b] for b in blocks],
        )

    def unpin(self, pin_id: int) -> None:
        """Release a transfer's blocks (a second call is a no-op)."""
        blocks = self._pins.pop(pin_id, None)
        if blocks:
            self.block_manager.release(blocks)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._pins.values())

    def import_blocks(self, fetched: FetchedBlocks) -> int:
        """Put blocks fetched from a peer (leading blocks of one prompt, in order) into the
        prefix cache under their own hashes; returns how many leading ones are now held.

        Blocks already held are kept as they are; the others get fresh blocks (evicting the
        least recently used cached ones) until the pool has none left.
        """
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return 0
        held: list[int] = []
        rows: list[int] = []  # rows of ``fetched`` to copy, into ``new``
        new: list[int] = []
        for i, block_hash in enumerate(fetched.hashes):
            existing = bm.match_prefix([block_hash])
            if existing:
                bm.reference(existing)
                held += existing
                continue
            try:
                block = bm.allocate()
            except NoFreeBlocksError:
                break
            rows.append(i)
            new.append(block)
            held.append(block)
        self.runner.write_blocks(new, rows, fetched.keys, fetched.values)
        for i, block in zip(rows, new):
            bm.cache_block(block, fetched.hashes[i], fetched.token_ids[i], fetched.parent(i))
        bm.release(held)  # now cached and evictable, the tail first
        self._flush_kv_events()
        return len(held)

    # ------------------------------------------------------------------ introspection
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the block pool is inconsistent."""
        tables = [s.block_table for s in self.scheduler.running + self.scheduler.waiting]
        tables += self._pins.values()
        self.block_manager.check_integrity(tables)
        for seq in self.scheduler.waiting:
            assert not seq.block_table, "a waiting sequence holds blocks"
        kept = Counter(h for s in self.scheduler.waiting for h in s.kept_hashes)
        assert kept == self.block_manager.keep_counts(), "kept hashes leaked or lost"
        assert not any(s.kept_hashes for s in self.scheduler.running), "a running seq keeps"
        queued = Counter(
            h for s in self.scheduler.running + self.scheduler.waiting
            for h in s.block_hashes[: s.num_queued_hashes]
        )  # fmt: skip
        assert queued == self.scheduler.prefix.queued_hashes, "queued hashes leaked or lost"
        live = len(self.scheduler.running) + len(self.scheduler.waiting)
        assert self.scheduler.preempt_stats.tracked <= live, "preemption state leaked"
        if self.host_pool is not None:
            self.host_pool.check_integrity(s.host_blocks for s in self.scheduler.waiting)

    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        bm = self.block_manager
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_usage=bm.usage(),
            num_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks,
            cached_blocks=bm.num_cached_blocks,
            queued_tokens=sched.outstanding_tokens(),
            kept_hashes=bm.num_kept_hashes,
            kept_evictions=bm.kept_evictions,
            prefix_cache_queries=sched.stats.prefix_cache_queries,
            prefix_cache_hits=sched.stats.prefix_cache_hits,
            preemptions=sched.stats.preemptions,
            swapped_out=sched.stats.swapped_out,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            finished_by_reason=dict(self._finished_by_reason),
            preempt=sched.preempt_stats.counts(),
        )
