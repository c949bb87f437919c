"""Eviction orders (prefixmesh/eviction.py): victim order on crafted workloads, no orphans,
block-pool integrity and exact KV events after eviction storms, identical greedy outputs with
each policy, and the offline-optimal (Belady) ceiling on a crafted trace."""

from __future__ import annotations

import random

import pytest
from test_engine import make_llm, random_prompts

from loadtest.ceilings import add_ceilings, ceiling
from loadtest.report import ceiling_rows
from loadtest.request import LoadRequest
from prefixmesh.eviction import EVICTION_POLICIES, make_order
from replica import SamplingParams
from replica.block_manager import BlockManager


class Pool:
    """A BlockManager driven the way the scheduler drives it, with its KV events mirrored."""

    def __init__(self, num_blocks: int, eviction: str) -> None:
        self.mirror: set[bytes] = set()  # what the router would know (stored minus removed)
        self.removed = 0
        self.bm = BlockManager(
            num_blocks, 4, on_stored=self.mirror.add, on_removed=self._removed,
            eviction=eviction,
        )  # fmt: skip
        self.tables: list[list[int]] = []

    def _removed(self, h: bytes) -> None:
        self.mirror.remove(h)
        self.removed += 1

    def run(self, chain: list[bytes]) -> int:
        """A request with prompt ``chain``: found prefix touched and referenced, the rest
        computed; returns how many blocks it found. Call ``finish`` to release it."""
        found = self.bm.match_prefix(chain)
        self.bm.touch(found)
        self.bm.note_misses(chain[len(found) :])
        self.bm.reference(found)
        table = list(found)
        for i in range(len(found), len(chain)):
            b = self.bm.allocate()
            table.append(self.bm.cache_block(b, chain[i], None, chain[i - 1] if i else None))
        self.tables.append(table)
        return len(found)

    def finish(self) -> None:
        self.bm.release(self.tables.pop(0))

    def serve(self, chain: list[bytes]) -> int:
        n = self.run(chain)
        self.finish()
        return n

    def check(self) -> None:
        self.bm.check_integrity(self.tables)
        cached = self.bm.cached_hashes()
        assert self.mirror == cached, "the KV events no longer match the cache"
        for h in cached:  # no orphan: every cached block's parent is cached too
            parent = self.bm.block_parent[self.bm.match_prefix([h])[0]]
            assert parent is None or parent in cached, "a block outlived its parent"


def chain(name: str, n: int) -> list[bytes]:
    return [f"{name}:{i}".encode() for i in range(n)]


def test_one_shot_blocks_go_first():
    pool = Pool(8, "reuse")
    pool.serve(chain("conv", 4))
    assert pool.serve(chain("conv", 4)) == 4  # reused: protected
    pool.serve(chain("once", 4))  # newer, never found again
    pool.serve(chain("new", 4))  # needs 4 blocks: the one-shot ones go, not the older conv
    assert pool.bm.prefix_length(chain("conv", 4)) == 4
    assert pool.bm.prefix_length(chain("once", 4)) == 0
    pool.check()


@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
def test_a_parent_outlives_its_children(eviction):
    pool = Pool(8, eviction)
    pool.serve(chain("a", 6))
    for k in range(1, 7):  # every new block evicts one of a's: always its deepest left
        pool.serve(chain(f"x{k}", 1) + chain(f"y{k}", 0))
        held = pool.bm.prefix_length(chain("a", 6))
        assert sum(h in pool.bm.cached_hashes() for h in chain("a", 6)) == held
        pool.check()


def test_a_reused_chain_survives_a_scan_of_one_shot_requests():
    def survives(eviction: str) -> int:
        pool = Pool(32, eviction)
        pool.serve(chain("hot", 8))
        pool.serve(chain("hot", 8))
        for k in range(12):  # a scan: 48 one-shot blocks through a pool of 32
            pool.serve(chain(f"scan{k}", 4))
            pool.check()
        return pool.serve(chain("hot", 8))

    assert survives("reuse") == 8
    assert survives("lru") == 0  # the scan flushes LRU: the workload does test the policy


@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
def test_integrity_and_exact_events_after_eviction_storms(eviction):
    rng = random.Random(7)
    pool = Pool(24, eviction)
    roots = [chain(f"r{i}", rng.randint(1, 10)) for i in range(30)]
    waiting: list[list[bytes]] = []  # prefixes kept by waiting requests, as the scheduler keeps
    for step in range(400):
        c = rng.choice(roots)
        c = c[: rng.randint(1, len(c))] + chain(f"tail{step}", rng.randint(0, 3))
        if rng.random() < 0.3:
            waiting.append(c[: rng.randint(1, len(c))])
            pool.bm.keep(waiting[-1])
        if pool.bm.num_free_blocks >= len(c):
            pool.run(c)
        if len(pool.tables) > 2 or (pool.tables and rng.random() < 0.5):
            pool.finish()
        if waiting and rng.random() < 0.3:
            pool.bm.unkeep(waiting.pop(0))
        pool.check()
    assert pool.removed > 200  # a storm: the pool turned over many times
    while pool.tables:
        pool.finish()
    pool.bm.reset_prefix_cache()
    pool.check()
    assert pool.bm.num_free_blocks == 24 and not pool.mirror


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="lru, reuse"):
        make_order("mru", 8)


def test_greedy_outputs_are_identical_with_each_policy(tiny_model_dir):
    prompts = random_prompts(6, (30, 60), seed=3)
    prompts += [p[:40] + q[:10] for p, q in zip(prompts, prompts[1:])]  # shared prefixes
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = {}
    for eviction in EVICTION_POLICIES:
        llm = make_llm(tiny_model_dir, num_kv_blocks=16, max_num_batched_tokens=128,
                       eviction=eviction)  # fmt: skip
        outs[eviction] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.check_integrity()
        stats = llm.engine.get_stats()
        assert stats.free_blocks == stats.num_blocks
    assert outs["reuse"] == outs["lru"]


def req(ids: list[int]) -> LoadRequest:
    return LoadRequest(index=0, token_ids=ids, max_tokens=1)


def test_belady_ceiling_on_a_crafted_trace():
    # Blocks of 1 token; a prompt of n+1 tokens can hit its first n blocks and takes n+1. A is
    # used again at the end; B and C are one-shot between. With 7 blocks LRU evicts A (the
    # oldest) for C, MIN evicts B (never used again) and keeps A's hit range.
    a, b, c = [1, 2, 3], [10, 11, 12], [20, 21, 22]
    trace = [req(a + [0]), req(b + [0]), req(c + [0]), req(a + [0])]
    lru = ceiling(trace, 1, 7)
    belady = ceiling(trace, 1, 7, eviction="belady")
    assert lru.cached_tokens == 0
    assert belady.cached_tokens == 3  # all of A's blocks on its second use
    assert ceiling(trace, 1, None).cached_tokens == 3  # = the unlimited ceiling here


def test_the_report_carries_the_offline_optimal_ceiling():
    a, b, c = [1, 2, 3], [10, 11, 12], [20, 21, 22]
    trace = [req(a + [0]), req(b + [0]), req(c + [0]), req(a + [0])]
    summary = {"hit_rate": 0.125}
    add_ceilings(summary, trace, 1, 7)
    got = summary["ceilings"]
    assert got["capacity_aware"] == 0.0 and got["belady"] == 3 / 16
    assert got["fraction_of_belady"] == pytest.approx(0.125 / (3 / 16))
    assert any(label == "ceiling: offline-optimal" for label, _ in ceiling_rows(summary))
