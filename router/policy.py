"""Routing policies: pure functions from (request, live replica states) to one replica.

Every policy sees the same inputs, built by the router from one Redis lookup:

- ``RouteRequest``: how many prompt tokens and full blocks the request has, the tokens it will
  decode, and an ``affinity`` key for deterministic tie-breaks (the hash of the deepest block
  any replica holds, so it is shared by every request with that cached prefix).
- ``Candidate`` per live replica: the leading blocks it holds (``cached_blocks``, from its KV
  events) or will hold (``predicted_blocks``: cached, or recorded by a recent routing decision
  of any router), and its load.

**Load measure** (``Candidate.load``): outstanding tokens on the replica, the larger of (a) the
tokens routers have sent it and not seen finish (uncached prompt tokens + tokens to decode,
summed over every router through Redis) and (b) the ``queued_tokens`` the replica itself
reports (prompt tokens still to prefill plus tokens still to decode, leaving out the blocks a
waiting request will reuse). (a) reacts at once to
routing decisions; (b) catches work routers don't know about. Warm requests weigh little (their
prefix is not prefilled again), which is what lets a burst stay on its warm replica.

**Cost model** (cache_aware): ``cost = prefill_weight * uncached prompt tokens + load``, where
load leaves out the prefill of blocks that are only *predicted* there (an earlier request of the
same burst is computing them: that queued work is shared, not waited on twice).

**Saturation** (cache_aware): once every replica has at least ``saturation_tokens`` queued, a
prompt token that another replica holds or is computing costs ``duplicate_weight`` more on a
replica that would compute it again. Moving a request off its prefix then adds work that every
queued request waits for and saves the request little, as its wait is long anywhere. Without
this the cost model moved such requests to a shorter queue, and under overload that lost hits
and did not lower the median TTFT (docs/benchmarks.md, "Saturation: a duplicate costs more").

**Bounded load** (cache_aware): a replica is eligible only if, with this request added,
``load + w <= (1 + epsilon) * (total load + w) / N + slack`` (``w`` = the tokens this request
adds there). The least-loaded replica always qualifies when nothing else does, so no replica
sits above (1 + epsilon) x the mean load (plus ``slack`` tokens, so an idle cluster does not
scatter a burst) while others idle. Hot-prefix spillover falls out of this: when the warm
replica is out of bounds or its queue outweighs the prefill elsewhere, the request goes to the
next cheapest replica, which records a predicted entry and becomes warm for the next requests;
with more demand a third replica warms. Costs within ``tie_tokens`` are ties, won by the replica
holding the longest prefix, then by the highest rendezvous hash of (prefix, replica): when
demand cools, every router sends the prefix back to the same single replica and the extra
copies age out of the other caches.

**Cold placement** (cache_aware, ``cold_by="content"``): a prompt that no replica holds or is
computing any block of goes to the replica this router has sent the least distinct content
lately (``Candidate.routed_blocks``, router/balance.RoutedContent: sglang-router's "smallest
tree"), whatever its load, so that every replica's pool takes new blocks at the same rate and
evicts about what one LRU of the cluster's memory would. Ties go to the lesser load, then to the
rendezvous hash. Only replicas within the request bound qualify, and only those whose load is at
most ``cold_load_factor`` x the least loaded's + ``cold_load_slack_tokens``: a replica that
stalls takes no cold prompts, however little it was sent. ``cold_by="load"`` prices a cold
prompt like any other (the cheapest within the bounds: the least loaded). Content placement
keeps 0.6-1.4% more of the capacity-aware ceiling on the synthetic trace's closed loops at the
same TTFT (docs/benchmarks.md, "Cold prompts to the least content").

**Fetch hint** (every policy): when the chosen replica holds fewer leading blocks of the prompt
than another replica actually has cached (spillover, or a policy blind to caches), the router
names that replica (``fetch_source``) in the request's ``fetch_hint``. The chosen replica may
then copy those blocks (``Replica.FetchBlocks``) instead of prefilling them, if its own cost
model says that is faster (replica/fetch/client.py). cache_aware's cost counts those
tokens at the fetch's price, not a prefill's:
``cost = prefill_weight * (uncached - fetchable) + fetch_weight * fetchable + load``, where
``fetchable`` are the prompt tokens some replica holds beyond what this one holds. With
``--fetch-weight auto`` ``fetch_weight`` is each replica's own: the prefill weight times
the ``fetch_cost`` its lease publishes (a fetched token's cost over a prefilled one's, as that
replica has measured them; capped at 1), so a replica whose fetches do not pay, or that does
not fetch, prices the prefix as a full prefill. And a fetch prices only the tokens whose copy
fits in the replica's empty blocks: past them each copied block evicts a cached one, and on a
cluster whose pools are full those evictions cost more hits than the fetch saves
(docs/benchmarks.md, "Without `chrt`"). The default (``off``) counts no fetch.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

WARM, SPILLOVER, COLD, FALLBACK = "warm", "spillover", "cold", "fallback"

# The request bound's epsilon where a request would hit nothing (``--balance-cold-requests-
# epsilon``): 0.1 while cold requests went by load (docs/benchmarks.md, "Cold requests keep
# nearer the mean"); as loose as the bound's own 0.25 since they go by content, which needs the
# room ("Cold prompts to the least content").
COLD_REQUEST_EPSILON = 0.25
# Cold placement (``--cold-by``): by the content this router sent each replica lately, or by
# load; and the load guard on the former (docs/benchmarks.md, "Cold prompts to the least
# content").
COLD_BY = ("content", "load")
COLD_LOAD_FACTOR = 8.0
COLD_LOAD_SLACK_TOKENS = 16384
# Saturation (``--saturation-tokens``, ``--duplicate-weight``): once every replica has this many
# tokens queued (eight steps of the replicas' default 1,024-token budget), a prompt token that
# another replica holds or is computing costs this much more where it would be computed again
# (docs/benchmarks.md, "Saturation: a duplicate costs more").
SATURATION_TOKENS = 8192
DUPLICATE_WEIGHT = 16.0


class RouteRequest(NamedTuple):
    """What a policy knows about a request (``prompt_tokens == 0``: not tokenized)."""

    prompt_tokens: int
    num_blocks: int
    block_size: int
    decode_tokens: int
    affinity: bytes = b""


class Candidate(NamedTuple):
    """One live replica as the policy sees it."""

    replica_id: str
    cached_blocks: int = 0
    predicted_blocks: int = 0
    inflight_tokens: int = 0
    queued_tokens: int = 0
    recent_requests: int = 0  # of this router's last decisions (router/balance.py)
    # What fetching a prompt token from a peer costs this replica against prefilling it (its
    # lease's ``fetch_cost``, measured there); None: it does not fetch.
    fetch_cost: float | None = None
    # Blocks its pool holds nothing in (the lease's, at least; None: unknown). A copy that fits
    # in them evicts nothing; past them every fetched block evicts a cached one.
    empty_blocks: int | None = None
    # Distinct prompt blocks this router has sent it lately (router/balance.RoutedContent);
    # None: not counted, and a cold prompt goes by load.
    routed_blocks: int | None = None

    @property
    def load(self) -> int:
        return max(self.inflight_tokens, self.queued_tokens)

    @property
    def matched_blocks(self) -> int:
        return max(self.cached_blocks, self.predicted_blocks)


class Decision(NamedTuple):
    """The chosen replica, why, and what the router expects from it."""

    replica_id: str
    outcome: str
    matched_blocks: int
    predicted_cached_tokens: int
    weight_tokens: int


def hit_tokens(request: RouteRequest, matched_blocks: int) -> int:
    """Prompt tokens a replica holding ``matched_blocks`` leading blocks skips (never the last:
    its logits are needed)."""
    if request.prompt_tokens <= 0:
        return 0
    return max(0, min(matched_blocks * request.block_size, request.prompt_tokens - 1))


def weight(request: RouteRequest, candidate: Candidate) -> int:
    """Tokens this request adds to ``candidate``'s load."""
    uncached = request.prompt_tokens - hit_tokens(request, candidate.matched_blocks)
    return uncached + request.decode_tokens


def rendezvous(affinity: bytes, replica_id: str) -> int:
    """Highest-random-weight score: the same on every router, stable as replicas come and go."""
    return xxhash.xxh3_64_intdigest(affinity + b"\0" + replica_id.encode())


def classify(request: RouteRequest, candidates: Sequence[Candidate], chosen: Candidate) -> str:
    """warm: sent where the prefix is (most) cached; spillover: a warmer replica was passed
    over; cold: no replica held any of it; fallback: the request was not tokenized."""
    if request.prompt_tokens <= 0:
        return FALLBACK
    best = max(c.matched_blocks for c in candidates)
    if best == 0:
        return COLD
    return WARM if chosen.matched_blocks >= best else SPILLOVER


def decide(request: RouteRequest, candidates: Sequence[Candidate], chosen: Candidate) -> Decision:
    return Decision(
        replica_id=chosen.replica_id,
        outcome=classify(request, candidates, chosen),
        matched_blocks=chosen.matched_blocks,
        predicted_cached_tokens=hit_tokens(request, chosen.matched_blocks),
        weight_tokens=weight(request, chosen),
    )


def fetch_source(candidates: Sequence[Candidate], chosen: Candidate) -> Candidate | None:
    """The replica to name in a fetch hint: the one holding the most leading blocks, if it
    holds more than ``chosen`` (cached ones only: predicted blocks are not computed yet)."""
    best = max(candidates, key=lambda c: c.cached_blocks, default=None)
    if best is None or best is chosen or best.cached_blocks <= chosen.cached_blocks:
        return None
    return best


class Policy(ABC):
    """Picks one of ``candidates`` (never empty) for ``request``; no I/O, no side effects
    beyond the policy's own counters."""

    name: str = ""

    @classmethod
    def create(cls, **knobs: float) -> Policy:
        """Build one from the router's cost knobs (``make_policy``); most policies use none."""
        return cls()

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision: ...


class RoundRobinPolicy(Policy):
    """Each replica in turn (by sorted id), ignoring caches and load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.replica_id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return decide(request, candidates, chosen)


class RandomPolicy(Policy):
    """A uniformly random replica."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        return decide(request, candidates, self._rng.choice(list(candidates)))


class LeastLoadedPolicy(Policy):
    """The replica with the least load; ties go to the prefix's rendezvous winner, so even
    without a cache index a repeated prefix tends to land on the same replica."""

    name = "least_loaded"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        chosen = min(
            candidates, key=lambda c: (c.load, -rendezvous(request.affinity, c.replica_id))
        )
        return decide(request, candidates, chosen)


class CacheAwarePolicy(Policy):
    """Lowest predicted cost among replicas within the load bound (module docstring)."""

    name = "cache_aware"

    def __init__(
        self,
        epsilon: float = 0.5,
        slack_tokens: int = 512,
        tie_tokens: int = 32,
        prefill_weight: float = 1.0,
        request_epsilon: float | None = None,
        request_slack: int = 2,
        fetch_weight: float | None = None,
        fetch_auto: bool = False,
        request_min: int = 32,
        request_cold_epsilon: float = COLD_REQUEST_EPSILON,
        saturation_tokens: int = SATURATION_TOKENS,
        duplicate_weight: float = DUPLICATE_WEIGHT,
        cold_by: str = "content",
        cold_load_factor: float = COLD_LOAD_FACTOR,
        cold_load_slack_tokens: int = COLD_LOAD_SLACK_TOKENS,
    ) -> None:
        if cold_by not in COLD_BY:
            raise ValueError(f"cold_by must be one of {', '.join(COLD_BY)}, got {cold_by!r}")
        self.epsilon = epsilon
        self.slack_tokens = slack_tokens
        self.tie_tokens = tie_tokens
        self.prefill_weight = prefill_weight
        self.request_epsilon = request_epsilon
        self.request_slack = request_slack
        # The request bound waits for this many of the router's decisions in its window: a
        # few requests say nothing about balance (a fresh router's first groups, tests, a
        # quiet cluster), and bounding them would only scatter prefixes.
        self.request_min = request_min
        # A replica where the request would hit nothing takes it only within this tighter
        # share (never looser than request_epsilon): cold requests fill the replicas nearer
        # the mean, so a replica that holds hot prefixes keeps headroom for their warm
        # requests instead of spilling them (docs/router.md, "Bounded requests").
        self.request_cold_epsilon = request_cold_epsilon
        self.fetch_weight = fetch_weight  # None: a prefix held elsewhere costs a full prefill
        # Without a fixed weight: each replica's own measured cost (Candidate.fetch_cost).
        self.fetch_auto = fetch_auto and fetch_weight is None
        # When every replica is queueing, a prefix computed twice is work every queued request
        # waits for, while moving the request saves it little: its wait is long anywhere.
        self.saturation_tokens = saturation_tokens
        self.duplicate_weight = duplicate_weight
        # Where a prompt no replica holds goes (module docstring, "Cold placement").
        self.cold_by = cold_by
        self.cold_load_factor = cold_load_factor
        self.cold_load_slack_tokens = cold_load_slack_tokens

    @classmethod
    def create(cls, **knobs: float) -> CacheAwarePolicy:
        bound = knobs.get("request_epsilon", -1.0)  # negative: no request bound
        fetch = knobs.get("fetch_weight", FETCH_OFF)  # FETCH_OFF: fetching not counted
        return cls(
            knobs["epsilon"], int(knobs["slack_tokens"]), int(knobs["tie_tokens"]),
            knobs["prefill_weight"], bound if bound >= 0 else None,
            fetch_weight=fetch if fetch >= 0 else None, fetch_auto=fetch == FETCH_AUTO,
            request_cold_epsilon=knobs.get("request_cold_epsilon", COLD_REQUEST_EPSILON),
            saturation_tokens=int(knobs.get("saturation_tokens", SATURATION_TOKENS)),
            duplicate_weight=knobs.get("duplicate_weight", DUPLICATE_WEIGHT),
            cold_by=COLD_BY[int(knobs.get("cold_by", 0))],
        )  # fmt: skip

    def _fetch_weight(self, candidate: Candidate) -> float | None:
        """What one prompt token another replica holds costs on ``candidate``: the fixed
        weight, or (auto) the prefill weight scaled by the replica's measured fetch cost, never
        above a prefill; None where fetching is not counted."""
        if self.fetch_weight is not None:
            return self.fetch_weight
        if self.fetch_auto and candidate.fetch_cost is not None:
            return self.prefill_weight * min(1.0, candidate.fetch_cost)
        return None

    def _fetchable_cap(self, request: RouteRequest, candidate: Candidate) -> int | None:
        """With the auto weight, the most held-elsewhere tokens priced as a fetch: those whose
        copy fits in the replica's empty blocks. Past them a copy evicts cached blocks, hits
        the cluster loses, so they cost a prefill (docs/fetch.md). None: no cap."""
        if self.fetch_weight is not None or candidate.empty_blocks is None:
            return None
        return candidate.empty_blocks * request.block_size

    def saturated(self, candidates: Sequence[Candidate]) -> bool:
        """Every replica has at least ``saturation_tokens`` of work queued."""
        return min((c.load for c in candidates), default=0) >= self.saturation_tokens

    def cost(
        self,
        request: RouteRequest,
        candidate: Candidate,
        held_blocks: int = 0,
        duplicated_blocks: int = 0,
    ) -> float:
        """Prefill still owed there plus its load; with ``fetch_weight``, prompt tokens another
        replica holds (``held_blocks``, the most any replica has cached) cost a fetch instead
        (with the auto weight, as many as fit in the replica's empty blocks). Under saturation
        the caller passes ``duplicated_blocks``, the most any replica holds or is computing:
        each of those tokens this replica would compute again costs ``duplicate_weight``
        more."""
        hit = hit_tokens(request, candidate.matched_blocks)
        uncached = request.prompt_tokens - hit
        fetchable = 0
        fetch_weight = self._fetch_weight(candidate)
        if fetch_weight is not None:
            fetchable = max(0, hit_tokens(request, held_blocks) - hit)
            cap = self._fetchable_cap(request, candidate)
            if cap is not None:
                fetchable = min(fetchable, cap)
        # Blocks predicted but not cached yet are being prefilled there for an earlier request
        # of the same burst: that queued work is work this request shares, not waits behind
        # any longer than it would prefilling the prefix itself elsewhere.
        shared = hit_tokens(request, candidate.matched_blocks) - hit_tokens(
            request, candidate.cached_blocks
        )
        prefill = self.prefill_weight * (uncached - fetchable)
        if fetchable:
            prefill += (fetch_weight or 0.0) * fetchable
        duplicated = max(0, hit_tokens(request, duplicated_blocks) - hit)
        prefill += self.duplicate_weight * duplicated
        return prefill + max(0, candidate.load - shared)

    def within_bound(
        self, request: RouteRequest, candidate: Candidate, total_load: int, n: int
    ) -> bool:
        w = weight(request, candidate)
        limit = (1.0 + self.epsilon) * (total_load + w) / n + self.slack_tokens
        return candidate.load + w <= limit

    def within_request_bound(
        self, candidate: Candidate, total: int, n: int, request: RouteRequest | None = None
    ) -> bool:
        """This request keeps the replica's share of recent decisions within bounds: the
        tighter cold share where ``request`` would hit nothing there."""
        if self.request_epsilon is None or total < self.request_min:
            return True
        epsilon = self.request_epsilon
        if request is not None and hit_tokens(request, candidate.matched_blocks) == 0:
            epsilon = min(epsilon, self.request_cold_epsilon)
        limit = (1.0 + epsilon) * (total + 1) / n + self.request_slack
        return candidate.recent_requests + 1 <= limit

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """``within_bound``, ``within_request_bound`` and ``cost`` over every candidate, then the
        cheapest within ``tie_tokens``: the same arithmetic as those methods (so the same
        decisions, tests/test_router_policy.py holds a reference), with each candidate's
        numbers computed once, as this runs on every request."""
        pt, bs, decode = request.prompt_tokens, request.block_size, request.decode_tokens
        rows = []  # (candidate, load, hit tokens of its matched blocks, of its cached blocks)
        total = recent = held = matched_hit = 0
        for c in candidates:
            load = max(c.inflight_tokens, c.queued_tokens)
            matched = max(c.cached_blocks, c.predicted_blocks)
            if pt > 0:
                hit = max(0, min(matched * bs, pt - 1))
                hit_cached = max(0, min(c.cached_blocks * bs, pt - 1))
            else:
                hit = hit_cached = 0
            rows.append((c, load, hit, hit_cached))
            total += load
            recent += c.recent_requests
            held = max(held, c.cached_blocks)
            matched_hit = max(matched_hit, hit)
        n = len(rows)
        grow, slack = 1.0 + self.epsilon, self.slack_tokens
        bound = self.request_epsilon if recent >= self.request_min else None
        request_limit = cold_limit = 0.0
        if bound is not None:
            request_limit = (1.0 + bound) * (recent + 1) / n + self.request_slack
            cold = min(bound, self.request_cold_epsilon)
            cold_limit = (1.0 + cold) * (recent + 1) / n + self.request_slack
        if matched_hit == 0 and self.cold_by == "content":  # before any cost: none is needed
            if all(row[0].routed_blocks is not None for row in rows):
                return decide(request, candidates, self._place_cold(request, rows, cold_limit))
        eligible = [
            row
            for row in rows
            if row[1] + (w := pt - row[2] + decode) <= grow * (total + w) / n + slack
            and (
                bound is None
                or row[0].recent_requests + 1 <= (request_limit if row[2] else cold_limit)
            )
        ]
        if not eligible:
            eligible = [min(rows, key=lambda row: (row[1], row[0].recent_requests))]
        prefill_weight = self.prefill_weight
        held_hit = max(0, min(held * bs, pt - 1)) if pt > 0 else 0
        saturated = min(row[1] for row in rows) >= self.saturation_tokens
        duplicate_weight = self.duplicate_weight if saturated else 0.0
        costs = []
        for c, load, hit, hit_cached in eligible:
            fetch_weight = self._fetch_weight(c)
            fetchable = max(0, held_hit - hit) if fetch_weight is not None else 0
            if fetchable and c.empty_blocks is not None and self.fetch_weight is None:
                fetchable = min(fetchable, c.empty_blocks * bs)
            prefill = prefill_weight * (pt - hit - fetchable)
            if fetchable:
                prefill += (fetch_weight or 0.0) * fetchable
            if duplicate_weight:
                prefill += duplicate_weight * (matched_hit - hit)
            costs.append(prefill + max(0, load - (hit - hit_cached)))
        cutoff = min(costs) + self.tie_tokens
        tied = [row for row, cost in zip(eligible, costs) if cost <= cutoff]
        if len(tied) == 1:
            chosen = tied[0][0]
        else:
            affinity = request.affinity
            chosen = max(
                tied,
                key=lambda row: (row[0].matched_blocks, rendezvous(affinity, row[0].replica_id)),
            )[0]
        return decide(request, candidates, chosen)

    def _place_cold(
        self, request: RouteRequest, rows: list[tuple[Candidate, int, int, int]], limit: float
    ) -> Candidate:
        """The replica for a prompt no replica holds (module docstring, "Cold placement"):
        ``rows`` are ``choose``'s (candidate, load, ...), ``limit`` its cold request limit (0:
        no request bound yet)."""
        ceiling = self.cold_load_factor * min(row[1] for row in rows) + self.cold_load_slack_tokens
        ok = [
            row
            for row in rows
            if row[1] <= ceiling and (not limit or row[0].recent_requests + 1 <= limit)
        ]
        if not ok:
            return min(rows, key=lambda row: (row[1], row[0].recent_requests))[0]
        affinity = request.affinity
        return min(
            ok,
            key=lambda row: (
                row[0].routed_blocks, row[1], -rendezvous(affinity, row[0].replica_id)
            ),
        )[0]  # fmt: skip


def make_policy(
    name: str,
    *,
    epsilon: float = 2.0,
    slack_tokens: int = 512,
    tie_tokens: int = 32,
    prefill_weight: float = 8.0,
    request_epsilon: float | None = None,
    fetch_weight: float | str | None = None,
    request_cold_epsilon: float = COLD_REQUEST_EPSILON,
    saturation_tokens: int = SATURATION_TOKENS,
    duplicate_weight: float = DUPLICATE_WEIGHT,
    cold_by: str = "content",
) -> Policy:
    """A policy by its name in ``REGISTRY``."""
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r} ({', '.join(POLICIES)})")
    return REGISTRY[name].create(
        epsilon=epsilon, slack_tokens=slack_tokens, tie_tokens=tie_tokens,
        prefill_weight=prefill_weight,
        request_epsilon=-1.0 if request_epsilon is None else request_epsilon,
        fetch_weight=fetch_knob(fetch_weight), request_cold_epsilon=request_cold_epsilon,
        saturation_tokens=saturation_tokens, duplicate_weight=duplicate_weight,
        cold_by=cold_knob(cold_by),
    )  # fmt: skip


def cold_knob(cold_by: str) -> float:
    """``--cold-by`` as the policy knob (knobs are numbers): its index in ``COLD_BY``."""
    if cold_by not in COLD_BY:
        raise ValueError(f"cold_by must be one of {', '.join(COLD_BY)}, got {cold_by!r}")
    return float(COLD_BY.index(cold_by))


FETCH_OFF, FETCH_AUTO = -1.0, -2.0  # the fetch_weight knob's two non-weights


def fetch_knob(value: float | str | None) -> float:
    """``--fetch-weight`` as the policy knob: a weight >= 0, ``auto`` (each replica's measured
    cost, from its lease) or ``off``/None (a prefix held elsewhere costs a full prefill)."""
    if value is None or value == "off":
        return FETCH_OFF
    if value == "auto":
        return FETCH_AUTO
    weight = float(value)
    if weight < 0:
        raise ValueError(f"fetch_weight must be auto, off or a number >= 0 (got {value!r})")
    return weight


# Every policy by name: the one list that --policy, SetPolicy and make_policy use.
REGISTRY: dict[str, type[Policy]] = {
    p.name: p for p in (CacheAwarePolicy, RoundRobinPolicy, LeastLoadedPolicy, RandomPolicy)
}
POLICIES = tuple(REGISTRY)  # cache_aware (the default) first
