"""The paged KV block pool: allocation on demand, ref counts, prefix cache, eviction.

Every block is in exactly one of three states:
- free: no owner, no hash (in ``_free``),
- cached: no owner but holds the KV of a known block hash, reusable until evicted (in
  ``_evictable``, an eviction order by hash, ``--eviction``: ``prefixmesh/eviction.py``; or in
  ``_kept``, see below),
- in use: referenced by one or more sequences' block tables (``ref_count > 0``), hashed or not.

A block gets its hash (and remembers its token ids, which a peer fetching it needs) once it is
full of computed tokens; identical content computed twice keeps the first block as the cached
copy. A cached block is never written again, so a block pinned by a reference (a sequence, or a
transfer to a peer replica) holds the same KV until it is released. A request's cached prefix
counts as used when the request arrives (``touch``, from ``Scheduler.add``), not only when it is
admitted, so it outlasts blocks nobody has asked for while the request waits its turn.

A touch alone does not outlast a long queue: every request that arrives later touches its own
prefix, and the running requests' new blocks then evict the oldest waiting request's prefix
first, the one needed soonest. So a waiting request also *keeps* its prefix (``keep``, by hash,
until ``unkeep``; a hash not cached yet is kept once it is): kept blocks stay free to take, but
an allocation evicts them only once no other cached block is left (``_kept``, oldest first).

Changes to the set of cached hashes are reported through ``on_stored`` / ``on_removed`` so the
replica can mirror them to Redis.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterable

from prefixmesh.eviction import DEFAULT_EVICTION, EvictionOrder, make_order
from prefixmesh.hashing import BlockHash


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation cannot be served even after evicting every cached block."""


class BlockManager:
    """Owns the block pool; sequences hold block ids in their block tables."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_stored: Callable[[BlockHash], None] | None = None,
        on_removed: Callable[[BlockHash], None] | None = None,
        eviction: str = DEFAULT_EVICTION,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # The hash of the block before it in its prompt (None: the first block), so a chain
        # can be walked back to its root for a peer's warm start (``chain``).
        self.block_parent: list[BlockHash | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        # Cached, unreferenced, unkept blocks, by hash, in the order ``eviction`` takes them.
        self._evictable: EvictionOrder = make_order(eviction, num_blocks)
        # Cached, unreferenced blocks whose hash a waiting request keeps: evicted last.
        self._kept: OrderedDict[int, None] = OrderedDict()
        self._keep_counts: dict[BlockHash, int] = {}  # hash -> waiting requests keeping it
        self.kept_evictions = 0  # kept blocks evicted all the same: nothing else was left
        self._hash_to_block: dict[BlockHash, int] = {}
        self._on_stored = on_stored or (lambda h: None)
        self._on_removed = on_removed or (lambda h: None)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take now (free plus cached unreferenced, kept or
        not)."""
        return len(self._free) + len(self._evictable) + len(self._kept)

    def keep_counts(self) -> dict[BlockHash, int]:
        """Each kept hash and how many waiting requests keep it (a copy)."""
        return dict(self._keep_counts)

    @property
    def num_kept_hashes(self) -> int:
        """Block hashes some waiting request keeps (held or not)."""
        return len(self._keep_counts)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._hash_to_block)

    def cached_block(
        self, block_hash: BlockHash
    ) -> tuple[tuple[int, ...] | None, BlockHash | None] | None:
        """(token ids, parent hash) of a cached block, None when the hash is not cached."""
        b = self._hash_to_block.get(block_hash)
        return None if b is None else (self.block_tokens[b], self.block_parent[b])

    def match_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the longest run of leading ``hashes`` held in the cache."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def prefix_length(self, hashes: Iterable[BlockHash], pending: Container = ()) -> int:
        """How many leading ``hashes`` are cached or in ``pending`` (being computed now)."""
        if not self.enable_prefix_caching:
            return 0
        held = self._hash_to_block
        n = 0
        for h in hashes:
            if h not in held and h not in pending:
                break
            n += 1
        return n

    def num_blocks_to_take(self, cached_blocks: list[int]) -> int:
        """How many of ``cached_blocks`` would leave the evictable pool if referenced now."""
        return sum(1 for b in cached_blocks if self.ref_counts[b] == 0)

    # ------------------------------------------------------------------ changes
    def reference(self, blocks: list[int]) -> None:
        """Take a reference on already-held blocks (a prefix-cache hit or a fork)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                self._unpark(b)
            self.ref_counts[b] += 1

    def _park(self, block: int) -> None:
        """A cached block nobody references waits to be evicted: in ``_kept`` if its hash is
        kept, else in the eviction order (as just used)."""
        h = self.block_hash[block]
        if h in self._keep_counts:
            self._kept[block] = None
        else:
            self._evictable.add(h, self.block_parent[block])

    def _unpark(self, block: int) -> None:
        h = self.block_hash[block]
        if h in self._keep_counts:
            del self._kept[block]
        else:
            self._evictable.remove(h)

    def touch(self, blocks: list[int]) -> None:
        """Mark cached ``blocks`` (a prefix, in order) as just used, so allocations evict them
        after every block nobody has asked for since. The tail is moved first, as ``release``
        orders them, so it stays the first of them to go. Referenced blocks are not evictable
        and stay as they are. The eviction order counts each block as reused."""
        for b in reversed(blocks):
            h = self.block_hash[b]
            if h is None:
                continue
            self._evictable.reused(h)
            if self.ref_counts[b] == 0:
                if h in self._keep_counts:
                    self._kept.move_to_end(b)
                else:
                    self._evictable.touch(h)

    def note_misses(self, hashes: Iterable[BlockHash]) -> None:
        """An arriving request wanted these blocks past its cached prefix: an adaptive order
        learns from the ones it evicted (``ReuseOrder.missed``)."""
        for h in hashes:
            self._evictable.missed(h)

    def keep(self, hashes: list[BlockHash]) -> None:
        """A waiting request keeps these hashes (its prefix, in order; cached now or to be
        computed): their blocks are evicted only after every block nobody keeps. Counted per call; ``unkeep`` gives
        them back. A kept block evicted all the same (a pool of nothing else) stays kept by
        hash: computed again, it is kept again."""
        held = self._hash_to_block
        for h in reversed(hashes):  # the tail first, as ``touch``: it stays the first to go
            count = self._keep_counts.get(h, 0)
            self._keep_counts[h] = count + 1
            b = held.get(h)
            if count == 0 and b is not None and h in self._evictable:
                self._evictable.remove(h)
                self._kept[b] = None

    def unkeep(self, hashes: list[BlockHash]) -> None:
        """Give back what ``keep(hashes)`` took; a block no request keeps any more rejoins
        the LRU order as just used."""
        held = self._hash_to_block
        for h in reversed(hashes):
            count = self._keep_counts.get(h, 0) - 1
            if count > 0:
                self._keep_counts[h] = count
                continue
            self._keep_counts.pop(h, None)
            b = held.get(h)
            if b is not None and b in self._kept:
                del self._kept[b]
                self._evictable.add(h, self.block_parent[b])

    def allocate(self) -> int:
        """A fresh block with one reference, evicting the eviction order's victim (a kept
        block, oldest first, only when nothing else is cached)."""
        if self._free:
            block = self._free.pop()
        elif self._evictable or self._kept:
            block = self._take_victim()
            self._drop(block)
        else:
            raise NoFreeBlocksError("KV cache is full")
        self.ref_counts[block] = 1
        return block

    def _take_victim(self) -> int:
        """Out of its pool: the cached, unreferenced block to evict next."""
        h = self._evictable.victim()
        if h is None:
            self.kept_evictions += 1
            block, _ = self._kept.popitem(last=False)
            return block
        self._evictable.remove(h)
        return self._hash_to_block[h]

    def _drop(self, block: int) -> None:
        """Forget a cached block's hash (reported as removed); the block holds nothing now."""
        h = self.block_hash[block]
        assert h is not None
        self._evictable.forget(h)
        self.block_hash[block] = None
        self.block_tokens[block] = None
        self.block_parent[block] = None
        del self._hash_to_block[h]
        self._on_removed(h)

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block; the tail is released first so it is evicted first."""
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} released more often than referenced"
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self._park(b)
                else:
                    self._free.append(b)

    def cache_block(
        self,
        block: int,
        block_hash: BlockHash,
        token_ids: tuple[int, ...] | None = None,
        parent: BlockHash | None = None,
    ) -> int:
        """Register a full block under its hash; returns the block that now holds the hash.

        ``token_ids`` are the block's tokens, kept so the block can be served to a peer;
        ``parent`` is the hash of the block before it in the prompt (None for the first).

        If the hash is already cached in another block (the same prefix computed twice in one
        step), that block stays the cached copy and ``block`` remains unhashed.
        """
        if not self.enable_prefix_caching:
            return block
        existing = self._hash_to_block.get(block_hash)
        if existing is not None:
            return existing
        if self.block_hash[block] is not None:
            return block
        self.block_hash[block] = block_hash
        self.block_tokens[block] = token_ids
        self.block_parent[block] = parent
        self._hash_to_block[block_hash] = block
        self._evictable.cached(block_hash, parent)
        self._on_stored(block_hash)
        return block

    def chain(self, block_hash: BlockHash) -> list[int]:
        """The cached blocks from the first block of ``block_hash``'s prompt to it, in order;
        empty when it or a block before it is not cached."""
        blocks: list[int] = []
        h: BlockHash | None = block_hash
        while h is not None:
            b = self._hash_to_block.get(h)
            if b is None or len(blocks) > self.num_blocks:
                return []
            blocks.append(b)
            h = self.block_parent[b]
        return blocks[::-1]

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block (returns how many)."""
        dropped = 0
        while self._evictable or self._kept:
            block = self._take_victim()
            self._drop(block)
            self._free.append(block)
            dropped += 1
        return dropped

    def check_integrity(self, block_tables: Iterable[list[int]]) -> None:
        """free + cached + in use == total, and ref counts equal block-table references."""
        expected = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                expected[b] += 1
        assert expected == self.ref_counts, "ref counts do not match the block tables"
        in_use = sum(1 for r in self.ref_counts if r > 0)
        free, cached = len(self._free), len(self._evictable) + len(self._kept)
        assert free + cached + in_use == self.num_blocks, (
            f"free {free} + cached {cached} + in use {in_use} != total {self.num_blocks}"
        )
        assert len(set(self._free)) == free, "a block is on the free list twice"
        for b in self._free:
            assert self.ref_counts[b] == 0 and self.block_hash[b] is None
            assert self.block_tokens[b] is None, f"free block {b} still names its tokens"
        evictable = [self._hash_to_block[h] for h in self._evictable]
        for b in evictable:
            assert self.ref_counts[b] == 0 and self.block_hash[b] is not None
            assert self.block_hash[b] not in self._keep_counts, f"kept block {b} not in _kept"
        for b in self._kept:
            assert self.ref_counts[b] == 0 and self.block_hash[b] in self._keep_counts
        assert len(set(evictable)) == len(evictable), "a cached block is listed twice"
        assert not set(self._kept) & set(evictable), "a cached block is listed twice"
        assert all(n > 0 for n in self._keep_counts.values()), "a hash kept zero times"
        for h, b in self._hash_to_block.items():
            assert self.block_hash[b] == h, f"hash index points at block {b} with another hash"
        hashed = sum(1 for h in self.block_hash if h is not None)
        assert hashed == len(self._hash_to_block), "a hashed block is missing from the index"


class HostBlockPool:
    """Blocks of a host-memory KV pool that preempted sequences are swapped out to.

    Only used where the device has memory of its own (CUDA), or when swap is forced for tests.
    No prefix caching here: a host block belongs to exactly one swapped-out sequence.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise NoFreeBlocksError("host swap space is full")
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def check_integrity(self, host_tables: Iterable[list[int]]) -> None:
        used = [b for table in host_tables for b in table]
        assert len(used) == len(set(used)), "a host block is owned twice"
        assert not set(used) & set(self._free), "a swapped-out block is also free"
        assert len(used) + len(self._free) == self.num_blocks, "host blocks leaked"
