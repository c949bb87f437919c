"""Offline replay of a load-test workload through the router's real policies and a model of the
replicas' engines: hit rate, miss attribution and skew in seconds, without a cluster.

Why: on a 2-core machine a SmolLM2 cluster serves ~3 requests/s, so one policy comparison over
1,000 trace requests takes tens of minutes. Routing quality depends on *which* blocks are where
and on how loaded each replica looks, far less on exact timings, so a faithful model of those
two things is enough to explore policies. It must be validated against a real cluster run
(docs/benchmarks.md has the comparison).

What is real and what is modelled:

- **Real**: the workload (``loadtest.workload.build_workload``: the same token ids as
  ``prefixmesh loadtest``), block hashes (``prefixmesh.hashing``), the routing policies
  (``router.policy``), the candidates the router builds (leading cached blocks, leading
  cached-or-predicted blocks with the predicted-entry TTL, in-flight tokens held until the first
  token, then the decode tokens until the end, the replica's queued tokens, the larger of the two
  as load, the rendezvous affinity), and the miss attribution (``router.attribution``).
- **Modelled**: each replica's engine, as ``replica/scheduler.py`` and ``block_manager.py``
  work: FIFO admission under a per-step token budget (``max_num_batched_tokens``, chunked
  prefill), a waiting request matched against the prefix cache when it is admitted (one whose
  next block a running request is prefilling waits for it, and the lease's queued tokens leave
  such reused blocks out; its cached prefix is marked used when it arrives), hits
  referenced (out of the LRU order) while it runs, new blocks allocated by evicting the least
  recently used cached block, blocks cached as soon as a chunk fills them, released tail first
  when the request ends; generated tokens take blocks too. The Redis map is exact and instant
  (the real one lags by one engine step). With ``--fetch``, fetch-on-miss: the chosen replica
  copies, instantly, the leading blocks a peer has cached beyond its own when the transfer
  beats the prefill (``fetch_s_per_block``, 5 ms a transfer). ``--evict dup`` / ``fetched``
  let a replica evict first a cached block another replica also holds (known exactly, or only
  for blocks it fetched), ``--cold-placement oldest`` sends a prefix no replica holds to the
  pool whose eviction for it loses the longest-unused blocks, ``tree`` to the replica the
  fewest distinct blocks were sent since the start (the router's own ``--cold-by content``
  counts over two epochs of its window): what-ifs the replicas and router do not do
  (docs/benchmarks.md, "Duplicates and eviction"). ``--compare sglang_cache_aware`` runs a
  model of sglang-router's policy (``SglangCacheAwareModel``) in the router's place, without
  fetching, as sglang-router sends no fetch hint (docs/benchmarks.md, "sglang-router's policy
  in the simulator"). Step time = ``step_s + prefill_s x prefill tokens + decode_s x decoding
  sequences``: constants, not measured per step.

```bash
python -m loadtest.simulate --trace ../shared/data/traces/synthetic_trace.jsonl \
    --tokens-per-hash-id 16 --max-output-tokens 4 --limit 1000 --arrival closed \
    --concurrency 8 --replicas 3 --num-blocks 2912 \
    --compare cache_aware,round_robin,least_loaded
```
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.ceilings import ceiling
from loadtest.request import LoadRequest
from prefixmesh.hashing import block_hashes
from prefixmesh.reuse_order import ReuseOrder
from router.attribution import MISS_KINDS, MissAttribution, PendingMisses
from router.balance import RecentRequests, RoutedContent
from router.config import RouterConfig
from router.policy import (
    CacheAwarePolicy,
    Candidate,
    Decision,
    Policy,
    RouteRequest,
    decide,
    make_policy,
)
from router.prompt import fallback_affinity

_MODEL = "sim"
_ROUTER = RouterConfig()  # the router's defaults, which the simulation flags share
# The replica's --waiting-prefix-share default (replica/config.py, which the load tester does
# not import: docs/design.md; tests/test_loadtest_simulate.py checks the two agree).
WAITING_PREFIX_SHARE = 1.0
EVICT_POLICIES = ("lru", "dup", "fetched", "reuse")
COLD_PLACEMENTS = ("policy", "oldest", "tree")


@dataclass(frozen=True, slots=True)
class EngineModel:
    """One replica's engine: pool size, scheduling limits and step-time constants."""

    num_blocks: int = 2912
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    step_s: float = 0.02
    prefill_s: float = 0.002  # per prefilled token
    decode_s: float = 0.01  # per decoding sequence
    # Fetch-on-miss (replica/fetch/client.py), off unless --fetch: the chosen replica
    # copies the leading blocks a peer holds beyond its own when that beats prefilling them.
    fetch: bool = False
    fetch_s_per_block: float = 0.002  # SmolLM2 bf16: 370 KB a block at ~200 MB/s
    fetch_latency_s: float = 0.005
    # Which cached block a new one evicts (BlockPool): the replica's LRU, or duplicates first.
    evict: str = "lru"
    evict_window: int = 0  # dup / fetched: how far into the LRU order to look (0: all of it)
    # A waiting request keeps its cached prefix, evicted only after every unkept block, up to
    # this share of the pool (the replica's --waiting-prefix-share; 0: touched on arrival only).
    waiting_prefix_share: float = WAITING_PREFIX_SHARE


@dataclass(slots=True)
class SimRequest:
    req: LoadRequest
    hashes: list[bytes]
    replica: int = -1
    send: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    cached_tokens: int = 0
    computed: int = 0  # prompt + generated tokens computed
    generated: int = 0
    held: list[bytes] = field(default_factory=list)  # block keys it references, in order
    unhashed: int = 0  # blocks it holds that are not (yet) in the prefix cache
    held_tokens: int = 0  # router in-flight tokens held on its replica
    misses: PendingMisses | None = None
    predicted: list[bytes] = field(default_factory=list)  # hashes the router predicted for it
    kept: list[bytes] = field(default_factory=list)  # its cached prefix, kept while it waits

    @property
    def prompt_len(self) -> int:
        return len(self.req.token_ids)

    @property
    def total(self) -> int:
        return self.prompt_len + self.req.max_tokens


class BlockPool:
    """Prefix cache of one replica: referenced blocks, and cached ones in LRU order.

    ``evict`` picks the cached block a new one replaces: ``lru`` (the replica's rule: the least
    recently used), ``dup`` (the least recently used among the oldest ``evict_window`` that
    another replica also holds, by the exact cluster-wide ``holders`` count, else the least
    recently used), ``fetched`` (the same, where "another replica holds it" is known only for
    blocks this replica fetched from a peer) or ``reuse`` (the replica's ``--eviction reuse``:
    ``prefixmesh/reuse_order.py``, mirrored beside the LRU order, which the cold placement
    still reads for the pool's age; the blocks a waiting request keeps still go last). A block with a cached child here is never taken
    out of turn: the chain behind it would stop matching.
    """

    def __init__(
        self,
        num_blocks: int,
        evict: str = "lru",
        evict_window: int = 0,
        holders: dict[bytes, int] | None = None,
        parents: dict[bytes, bytes] | None = None,
    ) -> None:
        if evict not in EVICT_POLICIES:
            raise ValueError(f"evict must be one of {EVICT_POLICIES} (got {evict!r})")
        self.num_blocks = num_blocks
        self.refs: dict[bytes, int] = {}  # cached blocks referenced by running requests
        # cached, unreferenced, oldest first -> when it was last used (``clock``)
        self.lru: OrderedDict[bytes, float] = OrderedDict()
        self.clock = 0.0  # the simulated time, set by the replica before it changes the pool
        self.unhashed = 0  # blocks in use that hold no full cached block yet
        self.evicted = 0
        self.evicted_out_of_turn = 0
        self.evict = evict
        self.evict_window = evict_window
        # hash -> how many replicas' pools hold it (shared by the cluster's pools)
        self.holders = holders if holders is not None else {}
        self.parents = parents if parents is not None else {}
        self.children: dict[bytes, int] = {}  # cached children here, per parent hash
        self.marked: set[bytes] = set()  # fetched from a peer: it held them too
        self.kept: dict[bytes, int] = {}  # hash -> waiting requests keeping it (evicted last)
        self.order = ReuseOrder(num_blocks) if evict == "reuse" else None

    def holds(self, h: bytes) -> bool:
        return h in self.refs or h in self.lru

    def free(self) -> int:
        return self.num_blocks - len(self.refs) - len(self.lru) - self.unhashed

    def available(self) -> int:
        return self.free() + len(self.lru)

    def _added(self, h: bytes) -> None:
        self.holders[h] = self.holders.get(h, 0) + 1
        p = self.parents.get(h)
        if p is not None:
            self.children[p] = self.children.get(p, 0) + 1

    def _removed(self, h: bytes) -> None:
        n = self.holders[h] - 1
        if n:
            self.holders[h] = n
        else:
            del self.holders[h]
        p = self.parents.get(h)
        if p is not None:
            c = self.children[p] - 1
            if c:
                self.children[p] = c
            else:
                del self.children[p]
        self.marked.discard(h)

    def _duplicated(self, h: bytes) -> bool:
        if self.evict == "dup":
            return self.holders.get(h, 0) > 1
        return h in self.marked

    def victim(self, keep: set[bytes] | frozenset[bytes] = frozenset()) -> bytes | None:
        """The cached block to evict next (None: none outside ``keep``)."""
        if not self.lru:
            return None
        if self.order is not None:
            h = self.order.victim()
            if h is not None and h not in keep and h not in self.kept:
                return h
        oldest = next(self._eviction_order())
        if self.evict in ("dup", "fetched"):
            window = self.evict_window or len(self.lru)
            for h in itertools.islice(self._eviction_order(), window):
                if h not in keep and h not in self.children and self._duplicated(h):
                    if h != oldest:
                        self.evicted_out_of_turn += 1
                    return h
        return None if oldest in keep else oldest

    def _eviction_order(self) -> Iterator[bytes]:
        """Cached blocks in the order they go: least recently used first, but the blocks a
        waiting request keeps only after every other (as ``BlockManager.allocate``)."""
        if not self.kept:
            return iter(self.lru)
        kept = self.kept
        return itertools.chain(
            (h for h in self.lru if h not in kept), (h for h in self.lru if h in kept)
        )

    def eviction_age(self, n: int) -> float:
        """When the newest of the blocks that ``n`` new ones would evict (in LRU order) was
        last used: -inf while the pool has room, inf when it cannot make room."""
        k = n - self.free()
        if k <= 0:
            return float("-inf")
        if k > len(self.lru):
            return float("inf")
        return next(itertools.islice(self.lru.values(), k - 1, None))

    def _evict(self, h: bytes) -> None:
        del self.lru[h]
        if self.order is not None:
            self.order.forget(h)
        self._removed(h)
        self.evicted += 1

    def reference(self, h: bytes) -> None:
        if h in self.lru:
            del self.lru[h]
            if self.order is not None:
                self.order.remove(h)
        self.refs[h] = self.refs.get(h, 0) + 1

    def take(self, n: int) -> None:
        """Allocate ``n`` fresh blocks, evicting cached ones (``evict``)."""
        for _ in range(n):
            if self.free() <= 0 and self.lru:  # (a full pool of running requests over-commits:
                victim = self.victim()  # the engine would preempt; rare at these sizes)
                assert victim is not None
                self._evict(victim)
            self.unhashed += 1

    def cache(self, h: bytes) -> None:
        """A fresh block became full: it joins the prefix cache (deduplicated by hash)."""
        self.unhashed -= 1
        if h in self.refs or h in self.lru:
            self.reference(h)  # another request computed it too: share, free the duplicate
        else:
            self.refs[h] = 1
            self._added(h)
            if self.order is not None:
                self.order.cached(h, self.parents.get(h))

    def import_blocks(self, hashes: Sequence[bytes]) -> int:
        """Blocks fetched from a peer join the LRU order as cached, unreferenced blocks (the
        tail first, as ``LLMEngine.import_blocks`` releases them), while the pool has room
        for them; how many leading ones are now held."""
        ours = set(hashes)
        for h in hashes:  # the ones already here are not evicted for the others
            if h in self.lru:
                self._bump(h)
        held = 0
        for h in hashes:
            if not self.holds(h):
                if self.free() <= 0:
                    victim = self.victim(ours)
                    if victim is not None:
                        self._evict(victim)
                if self.free() <= 0:
                    break
                self._rejoin(h)
                self._added(h)
                self.marked.add(h)
            held += 1
        for h in reversed(hashes[:held]):
            if h in self.lru:
                self._bump(h)
        return held

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark cached blocks (a prefix, in order) as just used, tail first, as
        ``BlockManager.touch`` does for an arriving request; referenced ones stay as they are."""
        for h in reversed(hashes):
            if self.order is not None:
                self.order.reused(h)
            if h in self.lru:
                self.lru.move_to_end(h)
                self.lru[h] = self.clock
                if self.order is not None:
                    self.order.touch(h)

    def missed(self, hashes: Sequence[bytes]) -> None:
        """An arriving request wanted these blocks past its cached prefix (``reuse`` learns
        from the ones it evicted)."""
        if self.order is not None:
            for h in hashes:
                self.order.missed(h)

    def _bump(self, h: bytes) -> None:
        """A cached, unreferenced block moves to the young end without counting as used."""
        self.lru.move_to_end(h)
        if self.order is not None:
            self.order.touch(h)

    def _rejoin(self, h: bytes) -> None:
        """A block becomes cached and unreferenced, as just used."""
        self.lru[h] = self.clock
        if self.order is not None:
            self.order.add(h, self.parents.get(h))

    def release(self, held: Sequence[bytes], unhashed: int) -> None:
        """A request ended: its cached blocks rejoin the LRU order tail first."""
        self.unhashed -= unhashed
        for h in reversed(held):
            n = self.refs[h] - 1
            if n:
                self.refs[h] = n
            else:
                del self.refs[h]
                self._rejoin(h)


def _uncount(counts: dict[bytes, int], hashes: Sequence[bytes]) -> None:
    """Take one count of each of ``hashes`` off ``counts``, dropping those that reach 0."""
    for h in hashes:
        if counts[h] > 1:
            counts[h] -= 1
        else:
            del counts[h]


class ReplicaSim:
    def __init__(
        self,
        index: int,
        model: EngineModel,
        holders: dict[bytes, int] | None = None,
        parents: dict[bytes, bytes] | None = None,
    ) -> None:
        self.index = index
        self.id = f"replica-{index}"
        self.model = model
        self.pool = BlockPool(model.num_blocks, model.evict, model.evict_window, holders, parents)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.busy_until: float | None = None
        self.inflight = 0  # router-held tokens
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.fetched_tokens = 0
        self.queued: Counter[bytes] = Counter()  # prompt blocks of requests not finished

    def queued_tokens(self) -> int:
        """What the lease reports (``Scheduler.outstanding_tokens``): prompt tokens still to
        prefill plus tokens still to decode, where a waiting request's leading blocks that are
        cached or being prefilled by a running one do not count."""
        q = sum(r.total - r.computed for r in self.running)
        if not self.waiting:
            return q
        bs = self.model.block_size
        inflight = self._inflight_blocks(self.running)
        for r in self.waiting:
            reused = 0
            for h in r.hashes[: (r.prompt_len - 1) // bs]:
                if not (self.pool.holds(h) or h in inflight):
                    break
                reused += 1
            q += r.total - reused * bs
        return q

    def _inflight_blocks(self, requests: Sequence[SimRequest]) -> set[bytes]:
        """Prompt blocks these running requests are prefilling and have not cached yet."""
        bs = self.model.block_size
        out: set[bytes] = set()
        for r in requests:
            if r.computed < r.prompt_len:
                out.update(r.hashes[len(r.held) : r.prompt_len // bs])
        return out

    def _prefix_in_flight(self, r: SimRequest, inflight: set[bytes]) -> bool:
        """As the replica's scheduler (``wait_for_inflight_prefix``): whether the first block of
        ``r`` past its cached prefix is one a running request is prefilling now."""
        cacheable = (r.prompt_len - 1) // self.model.block_size
        hits = self.leading(r.hashes[:cacheable])
        return hits < cacheable and r.hashes[hits] in inflight

    def keep_prefix(self, r: SimRequest) -> None:
        """As the scheduler does for an arriving request (``Scheduler.add``): its cached
        prefix goes to the young end of the LRU order and, while the kept blocks stay within
        ``waiting_prefix_share`` of the pool, is kept until the request is admitted, with the
        blocks past it that a request queued before it will compute. Then the request's own
        prompt blocks join the queued ones."""
        cacheable = r.hashes[: (r.prompt_len - 1) // self.model.block_size]
        n = self.leading(cacheable)
        self.pool.touch(cacheable[:n])
        self.pool.missed(cacheable[n:])
        while n < len(cacheable) and cacheable[n] in self.queued:
            n += 1
        limit = self.model.waiting_prefix_share * self.pool.num_blocks
        if n and len(self.pool.kept) + n <= limit:
            for h in cacheable[:n]:
                self.pool.kept[h] = self.pool.kept.get(h, 0) + 1
            r.kept = list(cacheable[:n])
        self.queued.update(cacheable)

    def _unqueue(self, r: SimRequest) -> None:
        _uncount(self.queued, r.hashes[: (r.prompt_len - 1) // self.model.block_size])

    def _release_kept(self, r: SimRequest) -> None:
        _uncount(self.pool.kept, r.kept)
        r.kept = []

    def leading(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if not self.pool.holds(h):
                break
            n += 1
        return n

    def _admit(self, r: SimRequest, budget: int) -> int | None:
        bs = self.model.block_size
        cacheable = (r.prompt_len - 1) // bs
        hits = self.leading(r.hashes[:cacheable])
        computed = hits * bs
        num_new = min(r.prompt_len - computed, budget)
        needed = -(-(computed + num_new) // bs) - hits
        taken = sum(1 for h in r.hashes[:hits] if h in self.pool.lru)
        if self.pool.available() - taken < needed:
            return None
        self._release_kept(r)
        for h in r.hashes[:hits]:
            self.pool.reference(h)
        r.held = list(r.hashes[:hits])
        self.pool.take(needed)
        r.unhashed = needed
        r.computed = computed
        r.cached_tokens = min(computed, r.prompt_len - 1)
        return num_new

    def step(self, now: float) -> tuple[float, list[SimRequest], list[SimRequest]]:
        """One engine step from ``now``: its end time, requests that got their first token,
        and requests that finished."""
        bs = self.model.block_size
        budget = self.model.max_num_batched_tokens
        self.pool.clock = now
        plan: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            n = 1 if r.computed >= r.prompt_len else min(r.prompt_len - r.computed, budget)
            plan.append((r, n))
            budget -= n
        # A waiting request whose next prompt block a running one is prefilling waits for it
        # (the replica's scheduler does the same), the next one in line goes first.
        inflight = self._inflight_blocks(self.running)
        for r in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.model.max_num_seqs:
                break
            if inflight and self._prefix_in_flight(r, inflight):
                continue
            n = self._admit(r, budget)
            if n is None:
                break
            self.waiting.remove(r)
            self.running.append(r)
            plan.append((r, n))
            budget -= n
            inflight |= self._inflight_blocks([r])
        prefill = sum(n for r, n in plan if r.computed < r.prompt_len)
        decoding = sum(1 for r, n in plan if r.computed >= r.prompt_len)
        end = now + self.model.step_s + self.model.prefill_s * prefill
        end += self.model.decode_s * decoding
        first, done = [], []
        for r, n in plan:
            before = r.computed
            # blocks for the new tokens (those not allocated at admission)
            need = -(-(before + n) // bs) - (len(r.held) + r.unhashed)
            if need > 0:
                self.pool.take(need)
                r.unhashed += need
            r.computed = before + n
            # cache the blocks this chunk filled (generated tokens: unique, never hit)
            full = r.computed // bs
            for i in range(len(r.held), full):
                if r.unhashed <= 0:
                    break
                h = r.hashes[i] if i < len(r.hashes) else b"gen-%d-%d" % (r.req.index, i)
                r.unhashed -= 1
                self.pool.cache(h)
                r.held.append(h)
            if r.computed >= r.prompt_len:
                if r.first_token is None:
                    r.first_token = end
                    r.generated = 1
                    first.append(r)
                else:
                    r.generated += 1
                if r.generated >= r.req.max_tokens:
                    r.end = end
                    done.append(r)
        for r in done:
            self.running.remove(r)
            self._unqueue(r)
            self.pool.release(r.held, r.unhashed)
        return end, first, done


@dataclass(slots=True)
class SimResult:
    policy: str
    hit_rate: float
    requests_per_replica: list[int]
    hit_rate_per_replica: list[float]
    misses: dict[str, int]
    ttft_p50_s: float
    e2e_p50_s: float
    duration_s: float
    evicted_blocks: int
    decisions: dict[str, int]
    fetched_tokens: int = 0
    duplicate_share: float = 0.0  # mean share of cached blocks that are a second copy
    evicted_out_of_turn: int = 0  # evictions that passed over an older block (not lru)

    @property
    def skew(self) -> float:
        """max / mean requests per replica."""
        n = self.requests_per_replica
        return max(n) / (sum(n) / len(n)) if sum(n) else 0.0


class SglangCacheAwareModel:
    """A model of sglang-router's ``cache_aware`` policy (0.3.x, its defaults), to compare
    placements in the simulator: a peer's policy, not one the router offers.

    sglang-router keeps an approximate radix tree of the prompts it sent to each worker, never
    told of a worker's evictions (its own trim, 64 M characters a worker, is far beyond these
    windows), and counts each worker's requests in flight. Unless the load is imbalanced (the
    busiest worker has more than ``balance_abs`` requests over the idlest and more than
    ``balance_rel`` times its count: then the idlest), a request whose longest prefix match
    covers more than ``cache_threshold`` of the prompt goes to the worker holding that match,
    and any other to the worker whose tree is smallest. Here the tree is each replica's set of
    block hashes routed to it (a chained hash names its whole prefix) and the match is in
    blocks, where sglang-router matches characters.
    """

    name = "sglang_cache_aware"

    def __init__(
        self,
        replicas: int,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
    ) -> None:
        self.trees: list[set[bytes]] = [set() for _ in range(replicas)]
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def choose(
        self, hashes: Sequence[bytes], prompt_len: int, block_size: int, running: Sequence[int]
    ) -> int:
        """The replica index for a request, and the request joins its tree."""
        most, least = max(running), min(running)
        if most - least > self.balance_abs and most > least * self.balance_rel:
            chosen = running.index(least)
        else:
            matches = []
            for tree in self.trees:
                n = 0
                while n < len(hashes) and hashes[n] in tree:
                    n += 1
                matches.append(n)
            best = max(matches)
            if prompt_len and best * block_size / prompt_len > self.cache_threshold:
                chosen = matches.index(best)
            else:
                sizes = [len(t) for t in self.trees]
                chosen = sizes.index(min(sizes))
        self.trees[chosen].update(hashes)
        return chosen


class Simulation:
    """One policy over one workload: a discrete-event loop over arrivals and engine steps."""

    def __init__(
        self,
        requests: Sequence[LoadRequest],
        policy: Policy | SglangCacheAwareModel,
        replicas: int = 3,
        model: EngineModel = EngineModel(),
        concurrency: int | None = None,
        predicted_ttl_s: float = _ROUTER.predicted_ttl_ms / 1000,
        hold_predicted: bool = True,
        predicted_settle_s: float = _ROUTER.predicted_settle_ms / 1000,
        cold_placement: str = "policy",
        balance_window: int = 256,
        content_window: int = _ROUTER.cold_content_window,
    ) -> None:
        self.cold_placement = cold_placement
        self.model = model
        self.policy = policy
        self.holders: dict[bytes, int] = {}  # hash -> replicas holding it
        self.parents: dict[bytes, bytes] = {}  # hash -> the hash of the block before it
        self.replicas = [ReplicaSim(i, model, self.holders, self.parents) for i in range(replicas)]
        self._dup_samples: list[float] = []
        self.concurrency = concurrency
        self.predicted_ttl_s = predicted_ttl_s
        self.predicted_settle_s = predicted_settle_s  # kept after the first token
        # The router renews a request's predicted entries until its first token: a queued
        # request keeps its burst together however long it waits (router/routing.py).
        self.hold_predicted = hold_predicted
        self.predicted: list[dict[bytes, float]] = [{} for _ in range(replicas)]
        self.attribution = MissAttribution()
        self.decisions: dict[str, int] = {}
        self.recent = RecentRequests(balance_window)
        self.routed: list[set[bytes]] = [set() for _ in range(replicas)]  # blocks ever sent
        self.content = RoutedContent(content_window)  # the router's count, for cold_by content
        bs = model.block_size
        self.reqs = [
            SimRequest(r, block_hashes(r.token_ids, bs, _MODEL, r.cache_salt)) for r in requests
        ]
        for r in self.reqs:
            for a, b in itertools.pairwise(r.hashes):
                self.parents[b] = a
        self._seq = itertools.count()
        self._events: list[tuple[float, int, str, Any]] = []

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _candidates(self, r: SimRequest, now: float) -> list[Candidate]:
        out = []
        for rep, pred in zip(self.replicas, self.predicted, strict=True):
            cached = rep.leading(r.hashes)
            matched = cached
            while matched < len(r.hashes) and (
                rep.pool.holds(r.hashes[matched]) or pred.get(r.hashes[matched], 0.0) > now
            ):
                matched += 1
            out.append(
                Candidate(rep.id, cached, matched, rep.inflight, rep.queued_tokens(),
                          self.recent.count(rep.id), routed_blocks=self.content.count(rep.id))
            )  # fmt: skip
        return out

    def route(self, r: SimRequest, now: float) -> None:
        bs = self.model.block_size
        for p in self.replicas:
            p.pool.clock = now
        held = sum(len(p.pool.refs) + len(p.pool.lru) for p in self.replicas)
        if held:  # copies beyond the first of each block, as a share of the blocks held
            self._dup_samples.append(1.0 - len(self.holders) / held)
        cands = self._candidates(r, now)
        best = max(c.matched_blocks for c in cands)
        if r.hashes:
            affinity = r.hashes[best - 1] if best else r.hashes[-1]
        else:  # as router.prompt.fallback_affinity: the prompt itself
            affinity = fallback_affinity(r.req.token_ids, str(r.req.index))
        rr = RouteRequest(r.prompt_len, len(r.hashes), bs, r.req.max_tokens, affinity)
        if isinstance(self.policy, SglangCacheAwareModel):
            running = [len(p.waiting) + len(p.running) for p in self.replicas]
            d = decide(rr, cands, cands[self.policy.choose(r.hashes, r.prompt_len, bs, running)])
        else:
            d = self.policy.choose(rr, cands)
        if (
            best == 0
            and self.cold_placement != "policy"
            and isinstance(self.policy, CacheAwarePolicy)
        ):
            d = self._place_cold(rr, r, cands)
        i = next(k for k, c in enumerate(cands) if c.replica_id == d.replica_id)
        chosen = cands[i]
        self.routed[i].update(r.hashes)
        self.decisions[d.outcome] = self.decisions.get(d.outcome, 0) + 1
        rep = self.replicas[i]
        self.content.add(rep.id, r.hashes)
        self.recent.add(rep.id)
        r.replica, r.send, r.held_tokens = i, now, d.weight_tokens
        rep.inflight += d.weight_tokens
        r.predicted = r.hashes[chosen.cached_blocks :]
        hold = float("inf") if self.hold_predicted else now + self.predicted_ttl_s
        for h in r.predicted:
            self.predicted[i][h] = max(self.predicted[i].get(h, 0.0), hold)
        others = max((c.matched_blocks for c in cands if c is not chosen), default=0)
        r.misses = self.attribution.pending(r.hashes, r.prompt_len, bs, chosen.matched_blocks,
                                            others)  # fmt: skip
        if self.model.fetch and not isinstance(self.policy, SglangCacheAwareModel):
            self._fetch(r, rep)  # a replica fetches only what the router's hint names
        rep.keep_prefix(r)
        rep.waiting.append(r)
        if rep.busy_until is None:
            rep.busy_until = now
            self._push(now, "step", i)

    def _place_cold(self, rr: RouteRequest, r: SimRequest, cands: list[Candidate]) -> Decision:
        """A prefix no replica holds goes, among the replicas within the load bound, to the one
        whose pool would evict the longest-unused blocks for it (``oldest``: the cluster then
        evicts about what one LRU of its size would), or to the one the fewest distinct blocks
        were ever sent to (``tree``: sglang-router's rule for a request with no good match)."""
        assert isinstance(self.policy, CacheAwarePolicy)
        total = sum(c.load for c in cands)
        ok = [c for c in cands if self.policy.within_bound(rr, c, total, len(cands))] or cands
        index = {rep.id: k for k, rep in enumerate(self.replicas)}
        need = -(-r.total // self.model.block_size)

        def rank(c: Candidate) -> tuple[float, int]:
            k = index[c.replica_id]
            if self.cold_placement == "tree":  # as sglang-router: the fewest blocks ever sent
                return len(self.routed[k]), c.load
            return self.replicas[k].pool.eviction_age(need), c.load

        return decide(rr, cands, min(ok, key=rank))

    def _fetch(self, r: SimRequest, rep: ReplicaSim) -> None:
        """As a replica before it submits: copy the leading blocks the peer holding most of
        them has cached beyond this replica's, if the cost model says fetch (instant here: the
        transfer's time is not added to the request's)."""
        m = self.model
        cacheable = r.hashes[: (r.prompt_len - 1) // m.block_size]
        local = rep.leading(cacheable)
        held = max((p.leading(cacheable) for p in self.replicas if p is not rep), default=0)
        gain = held - local
        if gain <= 0:
            return
        fetch_s = m.fetch_latency_s + gain * m.fetch_s_per_block
        if fetch_s >= gain * m.block_size * m.prefill_s:
            return
        got = rep.pool.import_blocks(cacheable[:held]) - local
        rep.fetched_tokens += max(0, got) * m.block_size

    def run(self) -> SimResult:
        pending = list(self.reqs)
        if self.concurrency:
            for _ in range(min(self.concurrency, len(pending))):
                self._push(0.0, "send", pending.pop(0))
        else:
            for r in pending:
                self._push(r.req.planned_time or 0.0, "send", r)
            pending = []
        done: list[SimRequest] = []
        now = 0.0
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == "send":
                self.route(payload, now)
                continue
            rep = self.replicas[payload]
            if not rep.running and not rep.waiting:
                rep.busy_until = None
                continue
            end, first, finished = rep.step(now)
            for r in first:  # prefill done: only the decode stays outstanding
                if self.hold_predicted:
                    pred = self.predicted[payload]
                    for h in r.predicted:
                        if pred.get(h) == float("inf"):
                            pred[h] = end + self.predicted_settle_s
                keep = r.req.max_tokens
                rep.inflight -= max(0, r.held_tokens - keep)
                r.held_tokens = min(r.held_tokens, keep)
            for r in finished:
                rep.inflight -= r.held_tokens
                rep.requests += 1
                rep.prompt_tokens += r.prompt_len
                rep.cached_tokens += r.cached_tokens
                self.attribution.settle(r.misses, r.cached_tokens)
                done.append(r)
                if self.concurrency and pending:
                    self._push(end, "send", pending.pop(0))
            rep.busy_until = end
            self._push(end, "step", payload)
        return self._result(done, now)

    def _result(self, done: list[SimRequest], end: float) -> SimResult:
        prompt = sum(r.prompt_tokens for r in self.replicas)
        cached = sum(r.cached_tokens for r in self.replicas)

        def p50(xs: list[float]) -> float:
            xs = sorted(xs)
            return xs[len(xs) // 2] if xs else 0.0

        return SimResult(
            policy=self.policy.name,
            hit_rate=cached / prompt if prompt else 0.0,
            requests_per_replica=[r.requests for r in self.replicas],
            hit_rate_per_replica=[
                r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0 for r in self.replicas
            ],
            misses=self.attribution.snapshot(),
            ttft_p50_s=p50([(r.first_token or r.end) - r.send for r in done]),
            e2e_p50_s=p50([r.end - r.send for r in done]),
            duration_s=end,
            evicted_blocks=sum(r.pool.evicted for r in self.replicas),
            decisions=dict(sorted(self.decisions.items())),
            fetched_tokens=sum(r.fetched_tokens for r in self.replicas),
            duplicate_share=(
                sum(self._dup_samples) / len(self._dup_samples) if self._dup_samples else 0.0
            ),
            evicted_out_of_turn=sum(r.pool.evicted_out_of_turn for r in self.replicas),
        )


def simulate(
    requests: Sequence[LoadRequest],
    policy: str | Policy,
    replicas: int = 3,
    model: EngineModel = EngineModel(),
    concurrency: int | None = None,
    policy_factory: Callable[[str], Policy] = make_policy,
    cold_placement: str = "policy",
    balance_window: int = 256,
) -> SimResult:
    if policy == SglangCacheAwareModel.name:
        p: Policy | SglangCacheAwareModel = SglangCacheAwareModel(replicas)
    else:
        p = policy_factory(policy) if isinstance(policy, str) else policy
    sim = Simulation(
        requests, p, replicas, model, concurrency, cold_placement=cold_placement,
        balance_window=balance_window,
    )  # fmt: skip
    return sim.run()


def _row(res: SimResult, cap: float) -> dict[str, Any]:
    total = res.misses["cacheable"] or 1
    return {
        "policy": res.policy,
        "hit_rate": round(res.hit_rate, 4),
        "of_capacity_ceiling": round(res.hit_rate / cap, 3) if cap else None,
        "max/mean requests": round(res.skew, 3),
        "requests": res.requests_per_replica,
        **{k: round(res.misses[k] / total, 4) for k in ("hit", *MISS_KINDS)},
        "ttft_p50_s": round(res.ttft_p50_s, 2),
        "e2e_p50_s": round(res.e2e_p50_s, 2),
        "decisions": res.decisions,
        "fetched_tokens": res.fetched_tokens,
        "duplicate_share": round(res.duplicate_share, 4),
        "evicted_blocks": res.evicted_blocks,
        "evicted_out_of_turn": res.evicted_out_of_turn,
    }


def _add_simulation_flags(g: Any) -> None:
    """The simulator's own flags, beside the load tester's (``loadtest/cli.py``)."""
    g.add_argument("--replicas", type=int, default=3)
    g.add_argument("--num-blocks", type=int, default=2912, help="KV blocks per replica")
    g.add_argument("--sim-block-size", type=int, default=16)
    g.add_argument("--prefill-ms", type=float, default=2.0, help="per prefilled token")
    g.add_argument("--decode-ms", type=float, default=10.0, help="per decoding sequence")
    g.add_argument("--step-ms", type=float, default=20.0, help="fixed cost of an engine step")
    # The router's policy knobs, with its defaults (router/config.py).
    for name, kind, note in (
        ("balance_epsilon", float, ""),
        ("prefill_weight", float, ""),
        ("balance_requests_epsilon", float, " (negative: off)"),
        ("balance_cold_requests_epsilon", float, ""),
        ("balance_window", int, ""),
        ("cold_by", str, " (content or load)"),
        ("saturation_tokens", int, ""),
        ("duplicate_weight", float, " (0: off)"),
    ):
        g.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=getattr(_ROUTER, name),
            help="as the router's flag" + note,
        )  # fmt: skip
    g.add_argument(
        "--fetch", action="store_true",
        help="replicas fetch a prefix a peer holds when that beats prefilling it (docs/fetch.md)",
    )  # fmt: skip
    g.add_argument("--fetch-ms-per-block", type=float, default=2.0, help="transfer time a block")
    g.add_argument("--fetch-weight", type=float, default=-1.0, help="as the router's flag")
    g.add_argument(
        "--evict", choices=EVICT_POLICIES, default="lru",
        help="which cached block a replica evicts: its LRU (the replica's rule), the oldest one "
        "another replica also holds (dup, exact), or the oldest one it fetched (fetched)",
    )  # fmt: skip
    g.add_argument(
        "--evict-window", type=int, default=0,
        help="dup / fetched: look this far into the LRU order for a duplicate (0: all of it)",
    )  # fmt: skip
    g.add_argument(
        "--waiting-prefix-share", type=float, default=WAITING_PREFIX_SHARE,
        help="as the replica's flag: a waiting request keeps its cached prefix (and the blocks "
        "past it a request queued before it computes), evicted only after every block nobody "
        "waits for, up to this share of the pool (0: touched only)",
    )  # fmt: skip
    g.add_argument(
        "--cold-placement", choices=COLD_PLACEMENTS, default="policy",
        help="cache_aware: where a prefix no replica holds goes: the policy's choice; the "
        "replica within the load bound whose pool evicts the longest-unused blocks for it "
        "(oldest); or the one the fewest distinct blocks were sent to (tree)",
    )  # fmt: skip
    g.add_argument("--json", action="store_true", help="one JSON line per policy")


def engine_model(args: argparse.Namespace) -> EngineModel:
    """The replicas' engine model from the simulation flags."""
    return EngineModel(
        args.num_blocks, args.sim_block_size, step_s=args.step_ms / 1e3,
        prefill_s=args.prefill_ms / 1e3, decode_s=args.decode_ms / 1e3, fetch=args.fetch,
        fetch_s_per_block=args.fetch_ms_per_block / 1e3, evict=args.evict,
        evict_window=args.evict_window, waiting_prefix_share=args.waiting_prefix_share,
    )  # fmt: skip


def policy_factory(args: argparse.Namespace) -> Callable[[str], Policy]:
    """Policies by name, with the router's balance flags as the simulation flags set them."""
    eps = args.balance_requests_epsilon

    def factory(name: str) -> Policy:
        return make_policy(
            name, epsilon=args.balance_epsilon, prefill_weight=args.prefill_weight,
            request_epsilon=eps if eps >= 0 else None,
            fetch_weight=args.fetch_weight if args.fetch_weight >= 0 else None,
            request_cold_epsilon=args.balance_cold_requests_epsilon,
            saturation_tokens=args.saturation_tokens, duplicate_weight=args.duplicate_weight,
            cold_by=args.cold_by,
        )  # fmt: skip

    return factory


def simulation_parser(prog: str) -> argparse.ArgumentParser:
    """The load tester's flags (the workload) and the simulator's own."""
    from loadtest.cli import build_parser

    parser = build_parser()
    parser.prog = prog
    _add_simulation_flags(parser.add_argument_group("simulation"))
    return parser


def main(argv: list[str] | None = None) -> int:
    from loadtest.workload import build_workload

    args = simulation_parser("python -m loadtest.simulate").parse_args(argv)
    if args.workload is None:
        args.workload = "trace" if args.trace else "shared-prefix"
    requests = build_workload(args)
    model = engine_model(args)
    unl = ceiling(requests, model.block_size).hit_rate
    cap = ceiling(requests, model.block_size, model.num_blocks * args.replicas).hit_rate
    print(
        f"{len(requests)} requests; ceilings: unlimited {unl:.4f}, capacity-aware "
        f"{cap:.4f} ({model.num_blocks * args.replicas} blocks)"
    )
    concurrency = args.concurrency if args.arrival == "closed" else None
    factory = policy_factory(args)
    for name in (args.compare or "cache_aware").split(","):
        res = simulate(
            requests, name, args.replicas, model, concurrency, factory, args.cold_placement,
            args.balance_window,
        )  # fmt: skip
        row = _row(res, cap)
        print(json.dumps(row) if args.json else row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
