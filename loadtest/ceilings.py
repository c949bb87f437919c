"""Three ceilings for the prefix hit rate of a workload, computed offline from its token ids.

- **unlimited**: one cache that never evicts. A request finds cached every leading full block
  that an earlier request's prompt already contained. What routing could reach if KV memory
  were free.
- **capacity-aware**: one LRU cache of ``capacity_blocks`` blocks, as large as all the
  replicas' KV pools together (read from the cluster). What perfect routing without duplicate
  copies could reach with the memory the cluster actually has. The gap between the two is the
  part of the misses that no router can win back, only more memory.
- **offline-optimal** (``belady``): the same capacity evicting by Belady's MIN under the prefix
  rule (``loadtest/belady.py``): the block whose next use is farthest goes first. Its gap over
  the capacity-aware one is what a better eviction policy (``--eviction``) could win back.

All follow the replicas' rules (``replica/block_manager.py``): the last prompt token is never
served from cache (its logits are needed), so only blocks within the first ``len - 1`` tokens
count as hits; a request holds the blocks it finds while it runs, its new blocks evict the least
recently used ones, and afterwards every full block of its computed tokens (the prompt and its
generated tokens, which the load tester fixes with ``max_tokens`` and ``ignore_eos``) joins the
LRU order tail first, so a conversation's shared root is evicted after its private tail.
Generated tokens never count as hits (later prompts do not contain them). Requests are taken one at a time in send order
(no request pins blocks while another one runs), which is what an ideal cluster with this much
memory would see.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.belady import BeladyOrder, use_times
from loadtest.request import LoadRequest
from prefixmesh.eviction import EvictionOrder, LruOrder, make_order
from prefixmesh.hashing import block_hashes

_MODEL_ID = "loadtest"  # any fixed id: only equality of hashes matters here


@dataclass(frozen=True, slots=True)
class Ceiling:
    """Prompt tokens of the counted requests and the tokens a cache of this kind serves."""

    prompt_tokens: int
    cached_tokens: int
    capacity_blocks: int | None = None  # None: unlimited

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class LruBlockCache:
    """A prefix cache of block hashes, like one replica's block pool; evicts in ``order``
    (least recently used when none is given, as the replica's ``--eviction lru``)."""

    def __init__(self, capacity_blocks: int | None, order: EvictionOrder | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.order: EvictionOrder = order if order is not None else LruOrder()

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, h: bytes) -> bool:
        return h in self.order

    def match(self, hashes: Sequence[bytes], max_blocks: int) -> int:
        """Leading blocks of ``hashes`` (at most ``max_blocks``) held now; tells the order
        which were found and which were wanted but gone."""
        hits = 0
        for h in hashes[:max_blocks]:
            if h not in self.order:
                break
            hits += 1
        for h in hashes[:hits]:
            self.order.reused(h)
        for h in hashes[hits:max_blocks]:
            self.order.missed(h)
        return hits

    def insert(self, hashes: Sequence[bytes], transient: int = 0) -> None:
        """Run a request's blocks through the cache as a replica does: the blocks it finds are
        referenced (out of the eviction order while it runs), new ones are allocated, each
        evicting the order's victim, and when the request ends all of them rejoin the order
        tail first, the root last. ``transient`` blocks (a partly filled last block) take room
        while it runs and are then freed, not cached."""
        if self.capacity == 0:
            return
        order = self.order
        held = [h for h in hashes if h in order]
        for h in held:
            order.remove(h)
        kept = set(held)
        in_use = len(kept)
        fresh = [h for h in hashes if h not in kept]
        for i, h in enumerate(hashes):
            if h not in kept:
                order.cached(h, hashes[i - 1] if i else None)
        for i in range(len(fresh) + transient):
            if self.capacity is not None and len(order) + in_use >= self.capacity:
                victim = order.victim()
                if victim is None:
                    break  # the request alone fills the pool: its tail is not cached
                order.forget(victim)
            in_use += 1
            if i < len(fresh):
                kept.add(fresh[i])
        for i in range(len(hashes) - 1, -1, -1):
            h = hashes[i]
            if h in kept and h not in order:
                order.add(h, hashes[i - 1] if i else None)


def request_hashes(r: LoadRequest, block_size: int) -> list[bytes]:
    return block_hashes(r.token_ids, block_size, _MODEL_ID, r.cache_salt)


def _order(
    eviction: str, capacity_blocks: int | None, requests: list[LoadRequest], block_size: int
) -> EvictionOrder:
    """The cache's eviction order: a replica's policy by name, or ``belady`` (offline MIN,
    which reads the hit ranges of every request to come)."""
    if eviction != "belady":
        return make_order(eviction, capacity_blocks or 0)
    spans = [
        request_hashes(r, block_size)[: (len(r.token_ids) - 1) // block_size] for r in requests
    ]
    return BeladyOrder(use_times(spans))


def ceiling(
    measured: Iterable[LoadRequest],
    block_size: int,
    capacity_blocks: int | None = None,
    warmup: Iterable[LoadRequest] = (),
    eviction: str = "lru",
) -> Ceiling:
    """The hit rate of one cache of ``capacity_blocks`` (None: unlimited) over ``measured`` in
    send order, evicting by ``eviction`` (``lru``, ``reuse``, or ``belady``: offline optimal);
    ``warmup`` requests went earlier and warm the cache but do not count."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    warmup, measured = list(warmup), list(measured)
    order = _order(eviction, capacity_blocks, warmup + measured, block_size)
    cache = LruBlockCache(capacity_blocks, order)
    prompt = cached = 0
    seq = 0
    for counted, reqs in ((False, warmup), (True, measured)):
        for r in reqs:
            if isinstance(order, BeladyOrder):
                order.now = seq
            seq += 1
            hashes = request_hashes(r, block_size)
            hits = cache.match(hashes, (len(r.token_ids) - 1) // block_size)
            # As on a replica: every full block of the computed tokens is cached (prompt, then
            # all generated tokens but the last, which is never computed), the partly filled
            # last block only takes room while the request runs. Blocks holding generated
            # tokens get keys of their own: no later prompt contains them.
            computed = len(r.token_ids) + max(1, r.max_tokens) - 1
            full = computed // block_size
            gen = [b"gen:%d:%d" % (seq, i) for i in range(len(hashes), full)]
            cache.insert(list(hashes[:full]) + gen, transient=1 if computed % block_size else 0)
            if counted:
                prompt += len(r.token_ids)
                cached += hits * block_size
    return Ceiling(prompt, cached, capacity_blocks)


def ceilings_summary(
    measured: list[LoadRequest],
    block_size: int,
    capacity_blocks: int | None,
    warmup: list[LoadRequest] = (),
) -> dict[str, object]:
    """The ``ceilings`` block of a run's summary (capacity-aware only when the capacity is
    known: a router reports its replicas' pool sizes, a bare replica its own; so is the
    offline-optimal ``belady`` one, the same capacity evicting by ``loadtest/belady.py``)."""
    unlimited = ceiling(measured, block_size, None, warmup)
    out: dict[str, object] = {
        "block_size": block_size,
        "unlimited": unlimited.hit_rate,
        "capacity_blocks": capacity_blocks,
        "capacity_aware": None,
        "belady": None,
    }
    if capacity_blocks:
        out["capacity_aware"] = ceiling(measured, block_size, capacity_blocks, warmup).hit_rate
        out["belady"] = ceiling(measured, block_size, capacity_blocks, warmup, "belady").hit_rate
    return out


def fraction_of(achieved: float | None, ceiling_rate: float | None) -> float | None:
    """``achieved / ceiling_rate``, None when either is unknown or the ceiling is 0."""
    if achieved is None or not ceiling_rate:
        return None
    return achieved / ceiling_rate


def add_ceilings(
    summary: dict[str, Any],
    measured: list[LoadRequest],
    block_size: int,
    capacity_blocks: int | None,
    warmup: list[LoadRequest] = (),
) -> None:
    """Put both ceilings and the achieved rate's fraction of each into a run's summary.

    ``best_hit_rate`` (the unlimited ceiling) keeps its old key for existing readers."""
    c = ceilings_summary(measured, block_size, capacity_blocks, warmup)
    achieved = summary.get("hit_rate")
    cluster = summary.get("cluster")
    if cluster and cluster.get("hit_rate") is not None:
        achieved = cluster["hit_rate"]
    c["achieved"] = achieved
    c["fraction_of_unlimited"] = fraction_of(achieved, c["unlimited"])
    c["fraction_of_capacity_aware"] = fraction_of(achieved, c["capacity_aware"])
    c["fraction_of_belady"] = fraction_of(achieved, c["belady"])
    summary["block_size"] = block_size
    summary["best_hit_rate"] = c["unlimited"]
    summary["ceilings"] = c
