"""Block pool unit tests: exact block ids, ref counts, LRU eviction order and KV events."""

from __future__ import annotations

import pytest

from prefixmesh.hashing import block_hashes, root_hash
from replica.block_manager import BlockManager, NoFreeBlocksError


def make(num_blocks: int = 4):
    stored, removed = [], []
    bm = BlockManager(num_blocks, 4, True, on_stored=stored.append, on_removed=removed.append)
    return bm, stored, removed


def test_allocates_lowest_ids_first_and_reuses_freed_blocks():
    bm, _, _ = make()
    table = [bm.allocate() for _ in range(3)]
    assert table == [0, 1, 2]
    bm.check_integrity([table])
    bm.release(table)
    bm.check_integrity([])
    assert bm.num_free_blocks == 4
    # The free list is a stack: the most recently freed blocks (warm in CPU caches) come back.
    assert [bm.allocate() for _ in range(4)] == [0, 1, 2, 3]


def test_cached_blocks_are_reused_then_evicted_least_recently_used():
    bm, stored, removed = make(num_blocks=3)
    hashes = block_hashes(list(range(12)), 4, "m")
    table = [bm.allocate() for _ in range(3)]
    for block, h in zip(table, hashes):
        bm.cache_block(block, h)
    assert stored == hashes
    bm.release(table)  # all three stay cached, tail first into the LRU
    bm.check_integrity([])
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 3
    assert bm.match_prefix(hashes) == [0, 1, 2]
    hit = bm.match_prefix(hashes[:2])
    bm.reference(hit)
    assert bm.ref_counts[:3] == [1, 1, 0]
    # The only evictable block is 2: a new allocation evicts it and reports its hash.
    assert bm.allocate() == 2
    assert removed == [hashes[2]]
    assert bm.match_prefix(hashes) == [0, 1]
    with pytest.raises(NoFreeBlocksError):
        bm.allocate()
    bm.check_integrity([[0, 1, 2]])


def cache_prompts(bm: BlockManager, *prompts: list) -> list[list[int]]:
    """Allocate and cache each prompt's blocks (its block hashes), in order: their tables."""
    tables = []
    for hashes in prompts:
        table = [bm.allocate() for _ in hashes]
        for block, h in zip(table, hashes):
            bm.cache_block(block, h)
        tables.append(table)
    return tables


def test_touched_prefix_is_evicted_after_blocks_nobody_asked_for():
    bm, _, removed = make(num_blocks=4)
    first = block_hashes(list(range(8)), 4, "m")  # an older prompt's two blocks
    second = block_hashes(list(range(100, 108)), 4, "m")
    tables = cache_prompts(bm, first, second)
    for table in tables:
        bm.release(table)  # LRU, oldest first: first's tail, first's head, second's tail, head
    held = bm.match_prefix(first)
    bm.reference(second_hit := bm.match_prefix(second[:1]))  # in use: touch leaves it alone
    bm.touch(held + second_hit)
    bm.check_integrity([second_hit])
    # The untouched block goes first; then the touched prefix, tail before head.
    assert [bm.allocate() for _ in range(3)] == [3, 1, 0]
    assert removed == [second[1], first[1], first[0]]


def test_kept_blocks_are_evicted_after_every_block_nobody_keeps():
    bm, _, removed = make(num_blocks=6)
    kept = block_hashes(list(range(8)), 4, "m")  # a waiting request's prefix, the oldest
    other = block_hashes(list(range(100, 116)), 4, "m")
    tables = cache_prompts(bm, kept, other)
    bm.keep(kept)
    assert bm.num_kept_hashes == 2
    bm.check_integrity(tables)
    for table in tables:
        bm.release(table)  # released after the keep: into the kept order, tail first
    bm.check_integrity([])
    assert bm.num_free_blocks == 6  # kept blocks can still be taken
    # Every unkept block goes first, however recently it was used; then the kept prefix,
    # tail first: a pool of nothing else evicts it all the same.
    assert [bm.allocate() for _ in range(6)] == [5, 4, 3, 2, 1, 0]
    assert removed == other[::-1] + kept[::-1]
    assert bm.kept_evictions == 2
    assert bm.num_kept_hashes == 2  # kept by hash: computed again, kept again
    bm.unkeep(kept)
    assert bm.num_kept_hashes == 0
    bm.check_integrity([[b] for b in range(6)])


def test_unkeep_returns_blocks_to_the_lru_order_as_just_used():
    bm, _, _ = make(num_blocks=4)
    a = block_hashes(list(range(4)), 4, "m")
    b = block_hashes(list(range(50, 54)), 4, "m")
    c = block_hashes(list(range(90, 94)), 4, "m")
    table = [bm.allocate() for _ in range(3)]
    for block, h in zip(table, a + b + c):
        bm.cache_block(block, h)
    bm.release(table)  # LRU: c's block 2, b's 1, a's 0 (released tail first)
    bm.keep(a)
    bm.keep(a)  # two waiting requests keep it: one unkeep leaves it kept
    bm.unkeep(a)
    bm.check_integrity([])
    assert bm.num_kept_hashes == 1
    assert bm.allocate() == 3 and bm.allocate() == 2 and bm.allocate() == 1
    bm.unkeep(a)  # now evicted in turn again, as just used
    bm.check_integrity([[3], [2], [1]])
    assert bm.allocate() == 0


def test_referencing_a_kept_block_takes_it_out_of_the_cached_pool():
    bm, _, _ = make(num_blocks=2)
    h = block_hashes(list(range(4)), 4, "m")
    block = bm.allocate()
    bm.cache_block(block, h[0])
    bm.release([block])
    bm.keep(h)
    bm.touch([block])
    bm.reference([block])  # the waiting request is admitted
    bm.unkeep(h)
    bm.check_integrity([[block]])
    assert bm.num_free_blocks == 1
    bm.release([block])
    bm.check_integrity([])
    assert bm.num_free_blocks == 2


def test_duplicate_content_keeps_the_first_cached_copy():
    bm, stored, _ = make()
    h = block_hashes([1, 2, 3, 4], 4, "m")[0]
    a, b = bm.allocate(), bm.allocate()
    assert bm.cache_block(a, h) == a
    assert bm.cache_block(b, h) == a
    assert stored == [h]
    bm.release([a, b])
    assert bm.num_cached_blocks == 1
    bm.check_integrity([])


def test_reset_prefix_cache_reports_removals():
    bm, _, removed = make()
    hashes = block_hashes(list(range(8)), 4, "m")
    table = [bm.allocate(), bm.allocate()]
    for block, h in zip(table, hashes):
        bm.cache_block(block, h)
    bm.release(table)
    assert bm.reset_prefix_cache() == 2
    assert sorted(removed) == sorted(hashes)
    assert bm.num_cached_blocks == 0
    bm.check_integrity([])


def test_integrity_check_catches_a_leak():
    bm, _, _ = make()
    bm.allocate()
    with pytest.raises(AssertionError):
        bm.check_integrity([])


def test_hash_chain_covers_model_salt_and_previous_blocks():
    tokens = list(range(32))
    base = block_hashes(tokens, 16, "m")
    assert block_hashes(tokens, 16, "m") == base
    assert block_hashes(tokens, 16, "other")[0] != base[0]
    assert block_hashes(tokens, 16, "m", cache_salt="t")[0] != base[0]
    changed = block_hashes([99] + tokens[1:], 16, "m")
    assert changed[0] != base[0] and changed[1] != base[1]  # chained: block 1 changes too
    assert root_hash("m") != root_hash("m", "t")
    assert len(block_hashes(tokens[:31], 16, "m")) == 1  # only full blocks
