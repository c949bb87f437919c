"""Prefix-cache bookkeeping of the scheduler's sequences: their chained block hashes, the
cached prefix a waiting sequence keeps, the blocks queued requests will compute, and which
blocks running prefills have in flight.

The block manager (replica/block_manager.py) holds the cache; this module decides what the
scheduler asks of it: blocks registered as they fill with computed tokens
(``cache_computed_blocks``), a waiting sequence's prefix kept against eviction while it
waits (``keep_prefix``), and whether a waiting sequence should sit a step out because a
running one is prefilling its next blocks (``prefix_in_flight``).
"""

from __future__ import annotations

from collections import Counter
from itertools import islice

from prefixmesh.hashing import extend_block_hashes
from replica.block_manager import BlockManager
from replica.config import EngineConfig
from replica.sequence import Sequence


class PrefixTracker:
    """The scheduler's view of the prefix cache, for one engine's sequences."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, model_id: str) -> None:
        self.config = config
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.model_id = model_id
        # The cacheable prompt block hashes of every sequence added and not finished: blocks
        # this replica will compute or has computed for a queued request (keep_prefix).
        self.queued_hashes: Counter = Counter()

    def enqueue(self, seq: Sequence) -> None:
        """An arriving sequence: keep its cached prefix, and count its cacheable prompt blocks
        among the queued ones (later arrivals keep theirs on over them, ``keep_prefix``)."""
        self.keep_prefix(seq, ahead=self.queued_hashes)
        if self.bm.enable_prefix_caching:
            seq.num_queued_hashes = self.cacheable(seq)
            self.queued_hashes.update(seq.block_hashes[: seq.num_queued_hashes])

    def forget(self, seq: Sequence) -> None:
        """A finished sequence: release what it kept and uncount its queued blocks."""
        self.release_kept(seq)
        queued = self.queued_hashes
        for h in seq.block_hashes[: seq.num_queued_hashes]:
            if queued[h] > 1:
                queued[h] -= 1
            else:
                del queued[h]
        seq.num_queued_hashes = 0

    def keep_prefix(self, seq: Sequence, ahead: Counter | None = None) -> None:
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
        hashes = seq.block_hashes[: self.cacheable(seq)]
        blocks = self.bm.match_prefix(hashes)
        self.bm.touch(blocks)
        self.bm.note_misses(hashes[len(blocks) :])
        self.release_kept(seq)
        n = len(blocks)
        if ahead:
            while n < len(hashes) and hashes[n] in ahead:
                n += 1
        limit = self.config.waiting_prefix_share * self.bm.num_blocks
        if n and self.bm.num_kept_hashes + n <= limit:
            seq.kept_hashes = hashes[:n]
            self.bm.keep(seq.kept_hashes)

    def release_kept(self, seq: Sequence) -> None:
        """The sequence stops waiting: what it kept is evicted in turn again."""
        if seq.kept_hashes:
            self.bm.unkeep(seq.kept_hashes)
            seq.kept_hashes = []

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

    def inflight_blocks(self, seqs: list[Sequence]) -> set:
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

    def reusable_blocks(self, seq: Sequence, inflight: set) -> int:
        """Leading blocks of ``seq`` that are cached or being prefilled by a running sequence."""
        cacheable = self.cacheable(seq)
        if len(seq.block_hashes) < cacheable:
            self.update_block_hashes(seq)
        return self.bm.prefix_length(islice(seq.block_hashes, cacheable), inflight)

    def prefix_in_flight(self, seq: Sequence, inflight: set) -> bool:
        """Whether ``seq``'s first block past its cached prefix is one a running sequence is
        prefilling: admitted now, it would compute that block (and likely more) again."""
        self.update_block_hashes(seq)
        cacheable = self.cacheable(seq)
        cached = len(self.bm.match_prefix(seq.block_hashes[:cacheable]))
        return cached < cacheable and seq.block_hashes[cached] in inflight

    def cacheable(self, seq: Sequence) -> int:
        """Leading blocks of ``seq`` a prefix-cache hit may cover. Never the last token: it
        needs logits. In batch-invariant mode not the last two: a lone new token would run in
        the decode attention kernel, whose sums round otherwise than the prefill kernel's
        (docs/fetch.md)."""
        keep = 2 if self.config.batch_invariant else 1
        return max(0, (seq.num_tokens - keep) // self.block_size)
