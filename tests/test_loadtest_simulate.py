"""The offline routing simulator (loadtest/simulate.py): its replica model against the
capacity-aware ceiling, and the policies it runs."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.ceilings import ceiling
from loadtest.request import LoadRequest
from loadtest.simulate import BlockPool, EngineModel, SglangCacheAwareModel, simulate
from loadtest.synthetic import SharedPrefixSpec, shared_prefix_requests
from loadtest.tokens import TokenBlocks
from loadtest.trace import TraceOptions, trace_requests
from loadtest.workload import SAMPLE_TRACE
from router.policy import make_policy


def _trace(limit: int, max_tokens: int = 1):
    from loadtest.trace import read_trace

    blocks = TokenBlocks(16, 49152, 100, 0)
    reqs = trace_requests(read_trace(SAMPLE_TRACE), blocks, TraceOptions(16, limit=limit))
    return [dataclasses.replace(r, max_tokens=max_tokens) for r in reqs]


@pytest.mark.parametrize(("num_blocks", "max_tokens"), [(64, 1), (64, 8), (256, 4), (100_000, 1)])
def test_one_replica_one_request_at_a_time_is_the_capacity_aware_ceiling(
    num_blocks: int, max_tokens: int
) -> None:
    # One replica serving one request at a time is exactly one LRU of num_blocks: the
    # simulator's engine model (admission, chunks, decode steps) must agree with the ceiling.
    reqs = _trace(120, max_tokens)
    sim = simulate(reqs, "round_robin", replicas=1, model=EngineModel(num_blocks), concurrency=1)
    expected = ceiling(reqs, 16, num_blocks)
    assert sim.hit_rate == pytest.approx(expected.hit_rate)
    assert sim.requests_per_replica == [120]
    m = sim.misses
    assert m["elsewhere"] == 0  # one replica: nowhere else to be
    assert sum(m[k] for k in ("hit", "compulsory", "evicted", "stale")) == m["cacheable"]
    if num_blocks == 100_000:  # nothing evicted: every miss is compulsory
        assert sim.misses["evicted"] == 0 and sim.evicted_blocks == 0


def test_block_pool_references_evicts_lru_and_releases_tail_first() -> None:
    pool = BlockPool(3)
    pool.take(2)
    pool.cache(b"r")
    pool.cache(b"a")
    pool.release([b"r", b"a"], 0)  # a joins the LRU order first
    assert list(pool.lru) == [b"a", b"r"] and pool.free() == 1
    pool.reference(b"r")
    pool.take(2)  # one free block, then evicts the oldest unreferenced: a
    assert not pool.holds(b"a") and pool.holds(b"r") and pool.evicted == 1


def _hot_groups():
    """Six shared-prefix groups of Zipf-skewed popularity, and an engine of 256 blocks."""
    spec = SharedPrefixSpec(num_groups=6, prompts_per_group=12, system_prompt_len=256,
                            question_len=32, output_len=4, zipf=0.8, seed=1)  # fmt: skip
    return shared_prefix_requests(spec, TokenBlocks(1, 49152, 100, 0)), EngineModel(num_blocks=256)


def test_cache_aware_beats_round_robin_and_the_request_bound_balances() -> None:
    reqs, model = _hot_groups()
    ca = simulate(reqs, "cache_aware", 3, model, concurrency=4)
    rr = simulate(reqs, "round_robin", 3, model, concurrency=4)
    assert ca.hit_rate > rr.hit_rate
    # Cold prompts placed by load pile the hot groups onto the idlest replicas; placed by the
    # content each replica was sent (the default), they spread at the same hit rate; the
    # request bound spreads them in either case.
    by_load = simulate(reqs, make_policy("cache_aware", cold_by="load"), 3, model, 4)
    assert ca.skew <= 1.3 < by_load.skew, (ca.requests_per_replica, by_load.requests_per_replica)
    assert ca.hit_rate >= by_load.hit_rate
    for cold_by in ("content", "load"):
        policy = make_policy("cache_aware", request_epsilon=0.2, cold_by=cold_by)
        bounded = simulate(reqs, policy, 3, model, 4)
        assert bounded.skew <= 1.3, (cold_by, bounded.requests_per_replica)
        assert bounded.hit_rate > rr.hit_rate
    assert sum(ca.requests_per_replica) == len(reqs)
    # deterministic: the same inputs give the same answer
    assert simulate(reqs, "cache_aware", 3, model, concurrency=4).hit_rate == ca.hit_rate


def test_block_pool_import_keeps_what_fits_tail_first() -> None:
    pool = BlockPool(3)
    pool.take(1)
    pool.cache(b"x")  # referenced: cannot be evicted
    assert pool.import_blocks([b"a", b"b", b"c"]) == 2  # two free blocks, nothing to evict
    assert list(pool.lru) == [b"b", b"a"] and pool.free() == 0  # the tail goes first
    assert pool.import_blocks([b"a", b"b"]) == 2  # already held: nothing taken


def test_fetching_turns_round_robins_elsewhere_misses_into_hits() -> None:
    reqs, model = _hot_groups()
    plain = simulate(reqs, "round_robin", 3, model, concurrency=4)
    fetched = simulate(reqs, "round_robin", 3, dataclasses.replace(model, fetch=True), 4)
    assert plain.fetched_tokens == 0 < fetched.fetched_tokens
    assert fetched.hit_rate > plain.hit_rate
    assert fetched.misses["elsewhere"] < plain.misses["elsewhere"]
    # A transfer slower than the prefill it saves: the cost model declines every fetch.
    slow = dataclasses.replace(model, fetch=True, fetch_s_per_block=1.0)
    assert simulate(reqs, "round_robin", 3, slow, concurrency=4).fetched_tokens == 0


def test_dup_eviction_takes_the_oldest_block_a_peer_holds_and_spares_parents() -> None:
    holders: dict[bytes, int] = {}
    parents = {b"c": b"p"}
    a = BlockPool(4, evict="dup", holders=holders, parents=parents)
    b = BlockPool(4, holders=holders, parents=parents)
    a.take(4)
    for h in (b"x", b"p", b"y", b"c"):
        a.cache(h)
    a.release([b"x"], 0)
    a.release([b"p"], 0)
    a.release([b"y"], 0)
    a.release([b"c"], 0)
    assert list(a.lru) == [b"x", b"p", b"y", b"c"] and a.free() == 0
    b.take(2)
    b.cache(b"p")  # a peer holds p (whose child c is cached here) and y
    b.cache(b"y")
    assert holders[b"p"] == holders[b"y"] == 2
    a.take(1)  # p has a child here: y, the oldest other duplicate, goes out of turn
    assert list(a.lru) == [b"x", b"p", b"c"] and a.evicted_out_of_turn == 1
    assert holders[b"y"] == 1
    a.take(1)  # no duplicate without a child left: the oldest, x
    assert list(a.lru) == [b"p", b"c"] and a.evicted_out_of_turn == 1
    a.take(1)  # the child rule only bars going out of turn: p is the oldest, it goes
    assert list(a.lru) == [b"c"] and a.evicted_out_of_turn == 1 and holders[b"p"] == 1


def test_fetched_eviction_takes_fetched_copies_first() -> None:
    pool = BlockPool(3, evict="fetched")
    pool.take(1)
    pool.cache(b"own")
    pool.release([b"own"], 0)
    assert pool.import_blocks([b"f1", b"f2"]) == 2  # marked: a peer held them
    assert list(pool.lru) == [b"own", b"f2", b"f1"] and pool.marked == {b"f1", b"f2"}
    pool.take(1)  # the oldest fetched copy, not the older block of our own
    assert list(pool.lru) == [b"own", b"f1"] and pool.marked == {b"f1"}
    assert pool.evicted_out_of_turn == 1


def test_eviction_age_is_when_the_newest_block_evicted_was_used() -> None:
    pool = BlockPool(3)
    pool.take(3)
    for t, h in enumerate((b"a", b"b", b"c")):
        pool.cache(h)
        pool.clock = float(t)
        pool.release([h], 0)
    assert pool.eviction_age(2) == 1.0  # evicts a (used at 0) and b (1)
    assert pool.eviction_age(4) == float("inf")
    pool.reference(b"a")
    pool.reference(b"b")
    assert pool.eviction_age(1) == 2.0
    assert BlockPool(3).eviction_age(3) == float("-inf")  # room: nothing evicted


def test_duplicate_share_counts_second_copies() -> None:
    reqs, model = _hot_groups()
    rr = simulate(reqs, "round_robin", 3, model, concurrency=4)
    one = simulate(reqs, "round_robin", 1, model, concurrency=4)
    assert rr.duplicate_share > 0.1 and one.duplicate_share == 0.0
    # duplicates first and cold placement by eviction age run, and stay deterministic
    dup = dataclasses.replace(model, evict="dup")
    for engine, cold in ((dup, "policy"), (model, "oldest")):
        first = simulate(reqs, "cache_aware", 3, engine, 4, cold_placement=cold)
        again = simulate(reqs, "cache_aware", 3, engine, 4, cold_placement=cold)
        assert first.hit_rate == again.hit_rate and sum(first.requests_per_replica) == len(reqs)


def test_a_burst_on_one_prefix_waits_for_its_first_prefill_and_hits_it() -> None:
    # Four requests on one 512-token prefix arrive together at one replica. The first one's
    # step leaves room for a second prompt, but the replica's scheduler holds the others back
    # until the prefix's blocks are cached (wait_for_inflight_prefix), so each of them hits the
    # whole prefix; admitted beside the first, the second would compute it again.
    prefix = list(range(10, 522))
    reqs = [LoadRequest(i, prefix + [600 + i] * 16, 2, planned_time=0.0) for i in range(4)]
    sim = simulate(reqs, "cache_aware", replicas=1, model=EngineModel(num_blocks=256))
    assert sim.misses["stale"] == 0
    assert sim.hit_rate == pytest.approx(3 * 512 / (4 * 528))


def test_the_sglang_router_model_routes_as_sglang_router_does() -> None:
    model = SglangCacheAwareModel(3)
    idle = [0, 0, 0]
    first = [b"a", b"b", b"c", b"d"]
    assert model.choose(first, 64, 16, idle) == 0  # every tree empty: the first smallest
    assert model.choose([b"x", b"y"], 32, 16, idle) == 1  # no match: the smallest tree
    # A match over cache_threshold (0.3) of the prompt goes to the tree holding it, even when
    # that tree is the largest and its worker the busiest (not imbalanced: 3 - 0 <= 64).
    assert model.choose([b"a", b"b", b"e", b"f"], 64, 16, [3, 0, 0]) == 0
    # A match at or under the threshold (1 block of 4: 0.25) is no match.
    assert model.choose([b"a", b"g", b"h", b"i"], 64, 16, idle) == 2
    # Imbalanced (over 64 requests apart and over 1.5x): the idlest, whatever the match.
    assert model.choose(first, 64, 16, [100, 90, 30]) == 2
    assert model.trees[2] >= set(first)  # the request joined the tree it was sent to


def test_the_sglang_router_model_and_cold_placement_by_tree_run_in_the_simulation() -> None:
    reqs, model = _hot_groups()
    fetching = dataclasses.replace(model, fetch=True)
    sglang = simulate(reqs, "sglang_cache_aware", 3, fetching, concurrency=4)
    assert sglang.policy == "sglang_cache_aware"
    assert sum(sglang.requests_per_replica) == len(reqs)
    # Every group's later requests match over the threshold where the first one went.
    assert sglang.misses["elsewhere"] == 0
    assert sglang.hit_rate > simulate(reqs, "round_robin", 3, model, concurrency=4).hit_rate
    first = simulate(reqs, "cache_aware", 3, model, 4, cold_placement="tree")
    again = simulate(reqs, "cache_aware", 3, model, 4, cold_placement="tree")
    assert first.hit_rate == again.hit_rate and sum(first.requests_per_replica) == len(reqs)


def test_the_sglang_router_model_fetches_nothing() -> None:
    # The second request shares one block of ten with the first: no match (0.1 <= 0.3), so it
    # goes to the smallest tree, away from the block. The replicas would fetch it when the
    # router names its holder, which sglang-router never does: it is computed again.
    shared = list(range(1, 17))
    reqs = [
        LoadRequest(i, shared + [100 * (i + 1) + t for t in range(144)], 1, planned_time=i)
        for i in range(2)
    ]
    fetching = EngineModel(num_blocks=256, fetch=True)
    sglang = simulate(reqs, "sglang_cache_aware", 3, fetching, concurrency=1)
    assert sglang.requests_per_replica[:2] == [1, 1]
    assert sglang.fetched_tokens == 0 and sglang.misses["elsewhere"] == 1
    ours = simulate(reqs, "round_robin", 3, fetching, concurrency=1)  # sent away too: fetches
    assert ours.fetched_tokens == 16 and ours.misses["elsewhere"] == 0


def test_a_queued_request_keeps_the_prefix_it_was_routed_for() -> None:
    # As the replica's scheduler does (Scheduler._keep_prefix): a request (R) that arrives
    # while a long prompt (L) fills the pool marks its cached prefix used, so L evicts the
    # blocks nobody waits for (B's) instead of the older ones R came for (A's). Without it, R
    # hits nothing and 9 blocks are evicted.
    prefix = list(range(1, 65))
    reqs = [
        LoadRequest(0, [*prefix, 1000], 1, planned_time=0.0),  # A
        LoadRequest(1, list(range(2000, 2065)), 1, planned_time=1.0),  # B
        LoadRequest(2, list(range(3000, 3576)), 1, planned_time=2.0),  # L: 36 blocks and more
        LoadRequest(3, [*prefix, *range(9000, 9016)], 1, planned_time=2.0001),  # R, queued
    ]
    engine = EngineModel(num_blocks=40, max_num_batched_tokens=64)
    sim = simulate(reqs, "round_robin", replicas=1, model=engine)
    assert sim.evicted_blocks == 5
    assert sim.hit_rate == pytest.approx(64 / (65 + 65 + 576 + 80))


def _hit_rates_kept_and_touched(reqs: list[LoadRequest]) -> tuple[float, float]:
    """Hit rates on one replica of 12 blocks, one sequence at a time: waiting requests keeping
    their prefixes (the default), and only touching them (``waiting_prefix_share`` 0)."""
    rates = []
    for share in (1.0, 0.0):
        engine = EngineModel(num_blocks=12, max_num_seqs=1, waiting_prefix_share=share)
        rates.append(simulate(reqs, "round_robin", replicas=1, model=engine).hit_rate)
    return rates[0], rates[1]


def test_a_waiting_request_keeps_its_prefix_while_requests_ahead_of_it_finish() -> None:
    # As the replica (BlockManager.keep): R arrives behind F and S (one sequence at a time).
    # F finishes after R's touch, so F's blocks are younger in the LRU order, and S then needs
    # more blocks than are free. Kept, R's prefix goes only after F's; touched only, first.
    prefix = list(range(1, 65))
    reqs = [
        LoadRequest(0, [*prefix, 1000], 1, planned_time=0.0),  # A: caches the prefix
        LoadRequest(1, list(range(2000, 2060)), 4, planned_time=1.0),  # F
        LoadRequest(2, list(range(3000, 3110)), 4, planned_time=1.0001),  # S
        LoadRequest(3, [*prefix, 9, 9, 9], 1, planned_time=1.0002),  # R, queued
    ]
    kept, touched = _hit_rates_kept_and_touched(reqs)
    assert kept == pytest.approx(64 / (65 + 60 + 110 + 67))
    assert touched < kept


def test_a_waiting_request_keeps_the_prefix_a_request_ahead_of_it_computes() -> None:
    # As the replica (Scheduler.add): W2's prefix is not cached when it arrives; W1, queued
    # ahead, will compute it. W2 keeps those hashes, so they outlast Y's younger blocks when
    # X needs more blocks than are free. Touched only, W2 finds half of them evicted.
    prefix = list(range(1, 65))
    reqs = [
        LoadRequest(0, list(range(1000, 1060)), 4, planned_time=0.0),  # running first
        LoadRequest(1, [*prefix, 1], 1, planned_time=0.0001),  # W1
        LoadRequest(2, list(range(2000, 2044)), 4, planned_time=0.0002),  # Y
        LoadRequest(3, list(range(3000, 3110)), 4, planned_time=0.0003),  # X
        LoadRequest(4, [*prefix, 9, 9, 9], 1, planned_time=0.0004),  # W2
    ]
    kept, touched = _hit_rates_kept_and_touched(reqs)
    assert kept == pytest.approx(64 / (60 + 65 + 44 + 110 + 67))
    assert touched < kept


def test_the_simulated_replica_keeps_waiting_prefixes_as_the_replica_does_by_default() -> None:
    from replica.config import EngineConfig

    assert EngineModel().waiting_prefix_share == EngineConfig().waiting_prefix_share
