"""What follows a routing decision: the plan's load on its replica, the blocks predicted
there, their renewal and settling, and the accounting left for after the send.

``Router.route`` (router/routing.py) decides; ``RouteBookkeeper`` keeps what that decision
promised true for the next ones. This router's own predicted entries live here, in the same
``ExpiringEntries`` type the mirror keeps other routers' in (router/expiring.py): renewed
until the request's first token (a burst behind a long queue stays together however long it
waits), then shortened to ``--predicted-settle-ms`` and, once the replica announces a block,
dropped (its KV events say from then on whether it still holds it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from redis.exceptions import RedisError

from prefixmesh.hashing import BlockHash
from proto import prefixmesh_pb2 as pb
from router.attribution import MissAttribution, PendingMisses
from router.config import RouterConfig
from router.discovery import ReplicaHandle
from router.expiring import ExpiringEntries
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.policy import Decision


class Bookkeeping(NamedTuple):
    """What a decision leaves for ``RouteBookkeeper.account``: records no later decision reads."""

    lookup_s: float | None  # the map lookup's time (None: no lookup)
    hashes: Sequence[BlockHash]  # the prompt's block hashes, for the miss attribution
    prompt_tokens: int
    block_size: int
    promised_blocks: int  # leading blocks the chosen replica holds or computes
    elsewhere_blocks: int  # the most another replica holds or computes
    predicted: list[BlockHash]  # blocks to record as predicted in Redis (none: no write)


@dataclass(slots=True)
class RoutePlan:
    """One routing decision and the in-flight tokens it holds on the chosen replica."""

    handle: ReplicaHandle
    decision: Decision
    prompt_ids: list[int] | None
    decode_tokens: int
    held_tokens: int = 0
    done: bool = False
    misses: PendingMisses | None = None  # settled when the replica reports its cached tokens
    prefilled: bool = False
    # A replica holding more of the prompt's leading blocks than the chosen one (policy.py's
    # fetch_source): sent along so the chosen replica may fetch them instead of prefilling.
    fetch_hint: pb.FetchHint | None = None
    unaccounted: Bookkeeping | None = None  # what RouteBookkeeper.account still has to do
    # Blocks predicted on the chosen replica for this request (RouteBookkeeper.settle
    # shortens them).
    predicted: list[BlockHash] = field(default_factory=list)

    @property
    def awaiting_prefill(self) -> bool:
        """No token yet: the replica is still queueing or prefilling the prompt."""
        return not self.done and not self.prefilled

    def settle_prefill(self) -> None:
        """First token seen: the prompt is prefilled, only decoding remains outstanding."""
        self.prefilled = True
        if not self.done and self.held_tokens > self.decode_tokens:
            self.handle.inflight_tokens -= self.held_tokens - self.decode_tokens
            self.held_tokens = self.decode_tokens

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.handle.inflight_tokens -= self.held_tokens
            self.handle.inflight_requests -= 1
            self.held_tokens = 0


@dataclass(slots=True)
class RedisLink:
    """How the bookkeeper reaches Redis through its router: whether it is up, what to call
    when a write fails (the router falls back), and how to run a write in the background."""

    is_up: Callable[[], bool]
    failed: Callable[[Exception], None]
    spawn: Callable[[Coroutine[Any, Any, None]], None]


class RouteBookkeeper:
    """This router's predicted entries and the plans whose predictions are still open."""

    def __init__(
        self,
        config: RouterConfig,
        index: PrefixIndex,
        metrics: RouterMetrics,
        attribution: MissAttribution,
        redis: RedisLink,
    ) -> None:
        self.config = config
        self.index = index
        self.metrics = metrics
        self.attribution = attribution
        self.redis = redis
        # Predicted entries this router wrote, checked locally so that its own next request
        # sees them even before the write reaches Redis.
        self.predicted = ExpiringEntries()
        # Plans still waiting for their first token, with the blocks predicted for them.
        self.awaiting: list[RoutePlan] = []
        # Predicted blocks of requests that have had their first token (or ended), per replica,
        # waiting for flush_settled to shorten their entries in Redis too.
        self.settled: dict[str, list[BlockHash]] = {}

    def commit(
        self, handle: ReplicaHandle, decision: Decision, hashes: Sequence[BlockHash]
    ) -> list[BlockHash]:
        """The decision's load and predicted blocks (``hashes``), which the next decision
        reads; returns those blocks (empty for a full hit: nothing to predict)."""
        handle.inflight_tokens += decision.weight_tokens
        handle.inflight_requests += 1
        handle.stats.requests += 1
        new = list(hashes)
        if new:
            expiry = time.monotonic() + self.config.predicted_ttl_ms / 1000
            self.predicted.put(handle.replica_id, new, expiry)
        return new

    def hold(self, plan: RoutePlan, predicted: list[BlockHash]) -> None:
        """``plan``'s predicted blocks, renewed until its first token (renew_predicted)."""
        if predicted:
            plan.predicted = predicted
            self.awaiting.append(plan)

    async def renew_predicted(self) -> None:
        """Extend the predicted entries of requests that have not had their first token."""
        live = [p for p in self.awaiting if p.awaiting_prefill and p.predicted]
        self.awaiting = live
        if not live:
            return
        expiry = time.monotonic() + self.config.predicted_ttl_ms / 1000
        mirrored = self.config.map_source == "mirror"
        by_replica: dict[str, list[BlockHash]] = {}
        for plan in live:
            rid = plan.handle.replica_id
            entries = self.predicted.setdefault(rid, {})
            if mirrored:  # not the blocks the replica has announced since
                plan.predicted = [h for h in plan.predicted if h in entries]
            self.predicted.extend(rid, plan.predicted, expiry)
            by_replica.setdefault(rid, []).extend(plan.predicted)
        if self.redis.is_up():
            for rid, hashes in by_replica.items():
                await self.record(rid, hashes)

    def announced(self, replica_id: str, hashes: Sequence[BlockHash]) -> None:
        """The mirror saw ``replica_id`` announce ``hashes``: its set says from now on whether
        the replica still holds them, so their predicted entries go."""
        self.predicted.drop(replica_id, hashes)

    def settle(self, plan: RoutePlan) -> None:
        """The replica has prefilled ``plan``'s prompt (its first token came), or the request
        ended: the replica's own KV events say which of the predicted blocks it holds (the
        mirror drops each entry as its block is announced), so what is left stays only
        ``--predicted-settle-ms`` more, time for the last events to reach the map. A prediction
        that outlived them would keep promising blocks the replica has since evicted: stale
        hits. Idempotent; cheap when nothing is predicted."""
        hashes = plan.predicted
        if not hashes:
            return
        plan.predicted = []
        rid = plan.handle.replica_id
        deadline = time.monotonic() + self.config.predicted_settle_ms / 1000
        self.predicted.shorten(rid, hashes, deadline)
        if self.redis.is_up():
            self.settled.setdefault(rid, []).extend(hashes)

    async def flush_settled(self) -> None:
        """Shorten, in Redis, the predicted entries ``settle`` shortened here (for other
        routers, and for the Redis lookup)."""
        settled, self.settled = self.settled, {}
        if not settled or not self.redis.is_up():
            return
        try:
            for rid, hashes in settled.items():
                await self.index.settle_predicted(rid, hashes, self.config.predicted_settle_ms)
        except (RedisError, OSError) as exc:
            self.redis.failed(exc)

    def account(self, plan: RoutePlan) -> None:
        """The bookkeeping ``route`` left for later (once; a no-op after): the lookup and
        routing metrics, the request's miss attribution state, and the predicted entries'
        Redis write for other routers (this router's own table is already updated)."""
        work = plan.unaccounted
        if work is None:
            return
        plan.unaccounted = None
        if work.lookup_s is not None:
            self.metrics.lookup.observe(work.lookup_s)
        decision, replica_id = plan.decision, plan.handle.replica_id
        self.metrics.routed(decision.outcome, replica_id, decision.predicted_cached_tokens)
        plan.misses = self.attribution.pending(
            work.hashes, work.prompt_tokens, work.block_size, work.promised_blocks,
            work.elsewhere_blocks,
        )  # fmt: skip
        if work.predicted:
            self.redis.spawn(self.record(replica_id, work.predicted))

    async def record(self, replica_id: str, hashes: list[BlockHash]) -> None:
        try:
            await self.index.record_predicted(replica_id, hashes)
        except (RedisError, OSError) as exc:
            self.redis.failed(exc)
