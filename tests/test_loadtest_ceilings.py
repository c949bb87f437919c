"""The two hit-rate ceilings of the load tester on hand-computed workloads."""

from __future__ import annotations

import pytest

from loadtest.ceilings import LruBlockCache, add_ceilings, ceiling, ceilings_summary
from loadtest.cluster import ClusterSnapshot, ReplicaCounters
from loadtest.request import LoadRequest


def _req(i: int, blocks: list[int], tail: int = 1) -> LoadRequest:
    """A prompt of full 4-token blocks ``blocks`` (block id b -> tokens 100b..100b+3) and
    ``tail`` extra tokens, so every full block is within the first len - 1 tokens."""
    ids = [100 * b + k for b in blocks for k in range(4)] + [7] * tail
    return LoadRequest(i, ids, 1)


def test_unlimited_and_capacity_aware_on_a_hand_computed_trace() -> None:
    # Blocks of 4 tokens. A = [1, 2], B = [3, 4], then A again, then B again.
    reqs = [_req(0, [1, 2]), _req(1, [3, 4]), _req(2, [1, 2]), _req(3, [3, 4])]
    prompt = 4 * 9
    # Unlimited: the 3rd and 4th requests find both blocks: 2 x 8 tokens.
    unl = ceiling(reqs, 4)
    assert (unl.prompt_tokens, unl.cached_tokens) == (prompt, 16)
    # Each request also takes a partly filled third block while it runs (9 tokens), so 5
    # blocks of capacity hold everything: same as unlimited.
    assert ceiling(reqs, 4, capacity_blocks=5).cached_tokens == 16
    # 3 blocks: B's two blocks and its partial one evict all of A, and so on: nothing found.
    assert ceiling(reqs, 3 + 1, capacity_blocks=3).cached_tokens == 0
    # 4 blocks, as a replica's pool (oldest first): after A [A2, A1]; B allocates B1, B2 and
    # its partial block, which evicts A2: [A1, B2, B1]. Request 2 finds A1 (4 tokens), pins it,
    # allocates A2 and a partial block, which evicts B2: [B1, A2, A1]. Request 3 finds B1.
    assert ceiling(reqs, 4, capacity_blocks=4).cached_tokens == 4 + 4


def test_lru_evicts_the_tail_before_the_root() -> None:
    cache = LruBlockCache(3)
    cache.insert([b"r", b"a1", b"a2"])  # joins tail first: a2 oldest, r newest
    cache.insert([b"r", b"b1"])  # references r, allocates b1 evicting the oldest: a2
    assert b"a2" not in cache and b"a1" in cache and b"r" in cache and b"b1" in cache
    assert cache.match([b"r", b"a1", b"a2"], 3) == 2
    assert len(cache) == 3
    cache.insert([b"x1", b"x2", b"x3", b"x4"])  # larger than the pool: its tail is not kept
    assert b"x1" in cache and b"x3" in cache and b"x4" not in cache and len(cache) == 3


def test_generated_tokens_take_blocks_in_the_capacity_aware_cache() -> None:
    # A = 2 blocks + 1 token. With max_tokens 8 it computes 9 + 7 = 16 tokens: 4 full blocks,
    # two of them hold generated tokens, cached under keys no prompt will ever match.
    a = _req(0, [1, 2])
    a.max_tokens = 8
    b = _req(1, [1, 2])
    assert ceiling([a, b], 4, capacity_blocks=4).cached_tokens == 8  # all 4 fit
    # 3 blocks: A's generated blocks joined the LRU order first (tail first), so they go
    # first, but B still finds A's prompt blocks
    assert ceiling([a, b], 4, capacity_blocks=3).cached_tokens == 8
    # C = 1 block + 1 token, between them: its block evicts A's generated block (the oldest),
    # its partial block then A2, so B finds A1 only
    c = _req(2, [3])
    assert ceiling([a, c, b], 4, capacity_blocks=3).cached_tokens == 4


def test_last_token_and_salt_rules_match_the_replicas() -> None:
    a = LoadRequest(0, list(range(8)), 1)  # two full blocks, the last token is in block 2
    b = LoadRequest(1, list(range(8)), 1)
    # b finds block 1 only: block 2 holds the last prompt token, never served from cache.
    assert ceiling([a, b], 4).cached_tokens == 4
    other = LoadRequest(2, list(range(8)), 1, cache_salt="tenant")
    assert ceiling([a, other], 4).cached_tokens == 0
    # warm-up requests warm the cache without being counted
    c = ceiling([b], 4, capacity_blocks=8, warmup=[a])
    assert (c.prompt_tokens, c.cached_tokens) == (8, 4)
    with pytest.raises(ValueError, match="block_size"):
        ceiling([a], 0)


def test_summary_block_and_fractions() -> None:
    reqs = [_req(0, [1, 2]), _req(1, [3, 4]), _req(2, [1, 2]), _req(3, [3, 4])]
    summary = {"hit_rate": 0.2, "cluster": {"hit_rate": 0.1}}
    add_ceilings(summary, reqs, 4, capacity_blocks=4)
    c = summary["ceilings"]
    assert c["unlimited"] == pytest.approx(16 / 36)
    assert c["capacity_aware"] == pytest.approx(8 / 36)
    assert c["achieved"] == 0.1  # the router's cluster rate wins over the client's
    assert c["fraction_of_unlimited"] == pytest.approx(0.1 / (16 / 36))
    assert c["fraction_of_capacity_aware"] == pytest.approx(0.1 / (8 / 36))
    assert summary["best_hit_rate"] == c["unlimited"]
    unknown = ceilings_summary(reqs, 4, None)
    assert unknown["capacity_aware"] is None


def test_cluster_capacity_is_the_sum_of_the_replicas_pools() -> None:
    snap = ClusterSnapshot("cache_aware")
    snap.replicas = {
        "a": ReplicaCounters("a", num_blocks=100),
        "b": ReplicaCounters("b", num_blocks=50),
    }
    assert snap.capacity_blocks == 150
    snap.replicas["c"] = ReplicaCounters("c")  # a replica that reports no pool
    assert snap.capacity_blocks is None
