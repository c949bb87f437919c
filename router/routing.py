"""The routing core: tokenize, hash, look up the block map, policy; the bookkeeping that
follows each decision is router/bookkeeping.py's.

The map lookup is local by default (``--map-source mirror``: an in-memory mirror of the block
sets, router/mirror.py) or one Redis round trip per request (``--map-source redis``).

``Router.route`` turns a ``GenerateRequest`` into a ``RoutePlan`` (the chosen replica and what
the router expects of it; router/bookkeeping.py). It never blocks on Redis for long: when Redis is unreachable the
router routes least-loaded over its last known replicas and a background task keeps trying to
reconnect; the first successful lookup switches cache-aware routing back on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from prefixmesh.hashing import BlockHash
from prefixmesh.request_defaults import requested_max_tokens, requested_n
from proto import prefixmesh_pb2 as pb
from router.attribution import MissAttribution
from router.balance import RecentRequests, RoutedContent
from router.bookkeeping import Bookkeeping, RedisLink, RouteBookkeeper, RoutePlan
from router.config import RouterConfig
from router.discovery import GROUP_KEY, ReplicaHandle, ReplicaView
from router.fastredis import PipelinedRedis
from router.fastredis import available as fast_ok
from router.index import HashGroup, MirrorIndex, PrefixIndex, ReplicaMatch
from router.metrics import RouterMetrics
from router.mirror import BlockMirror
from router.policy import (
    FALLBACK,
    Candidate,
    LeastLoadedPolicy,
    Policy,
    RouteRequest,
    fetch_source,
    make_policy,
)
from router.prompt import PromptTokens, fallback_affinity, tokenize

log = logging.getLogger("prefixmesh.router")


class NoReplicaError(RuntimeError):
    """No live replica can take the request."""


class Router:
    """Routes requests over the replicas found in Redis; owns the background refresh tasks."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.router_id = config.resolved_router_id()
        self.metrics = metrics or RouterMetrics()
        self.view = ReplicaView(
            config.keepalive_s, config.dead_grace_s, config.resolved_replica_api_key()
        )
        self.redis = aioredis.Redis.from_url(
            config.redis,
            socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s,
            # One immediate retry on a connection error only: after a Redis restart every pooled
            # connection is stale and fails once. Timeouts are not retried (fallback at once).
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        # The pipelined lookup connection speaks plain TCP only (not rediss:// or unix://).
        plain = config.redis.startswith("redis://")
        self.fast = (
            PipelinedRedis(config.redis, config.redis_timeout_s) if plain and fast_ok() else None
        )
        index_args = (
            config.namespace, self.router_id, config.predicted_ttl_ms, config.inflight_ttl_ms,
            self.fast,
        )  # fmt: skip
        self.mirror: BlockMirror | None = None
        self.index: PrefixIndex
        if config.map_source == "mirror":
            self.mirror = BlockMirror(
                config.redis, config.namespace, self.router_id, config.redis_timeout_s
            )
            self.index = MirrorIndex(self.redis, self.mirror, *index_args)
        else:
            self.index = PrefixIndex(self.redis, *index_args)
        self.policy = self.make_policy(config.policy)
        self._fallback = LeastLoadedPolicy()
        self.attribution = MissAttribution()  # why prompt blocks missed (router/attribution.py)
        self.recent = RecentRequests(config.balance_window)  # for the request bound
        # What this router sent each replica lately, for cold placement (router/balance.py).
        self.content = RoutedContent(config.cold_content_window)
        self.redis_ok = False
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        # What follows each decision: load held, predicted entries, their renewal and settling.
        link = RedisLink(
            lambda: self.redis_ok, lambda exc: self._set_redis(False, exc), self._spawn
        )
        self.book = RouteBookkeeper(config, self.index, self.metrics, self.attribution, link)
        if self.mirror is not None:
            self.mirror.on_added = self.book.announced

    def set_policy(self, name: str) -> None:
        """Route by policy ``name`` from now on (``SetPolicy``), with the request bound's
        window emptied: it held the previous policy's decisions, and a policy that keeps a hot
        prefix on one replica would inherit the spread of one that did not, letting that
        replica take the bound's share of the window *plus* what the old decisions left it.
        After a switch from least_loaded that read 1.36 x the mean requests over the next 300
        on the tiny cluster, against 1.16 from a fresh router (docs/benchmarks.md, "The issue's
        comparison on the current defaults")."""
        self.policy = self.make_policy(name)
        self.recent = RecentRequests(self.config.balance_window)

    def make_policy(self, name: str) -> Policy:
        c = self.config
        return make_policy(
            name, epsilon=c.balance_epsilon, slack_tokens=c.balance_slack_tokens,
            tie_tokens=c.tie_tokens, prefill_weight=c.prefill_weight,
            request_epsilon=c.balance_requests_epsilon if c.balance_requests_epsilon >= 0 else None,
            fetch_weight=c.fetch_weight, request_cold_epsilon=c.balance_cold_requests_epsilon,
            saturation_tokens=c.saturation_tokens, duplicate_weight=c.duplicate_weight,
            cold_by=c.cold_by,
        )  # fmt: skip

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.index.start()
        await self.refresh()
        loop = asyncio.get_running_loop()
        # With the mirror, leases and load come only from this refresh: as often as replicas
        # write them.
        every = self.config.discovery_interval_s
        if self.mirror is not None:
            every = min(every, self.config.state_refresh_s)
        self._tasks = [
            loop.create_task(self._every(every, self.refresh)),
            loop.create_task(self._every(self.config.inflight_flush_s, self.flush_inflight)),
            loop.create_task(self._every(self.config.inflight_flush_s, self.book.flush_settled)),
            loop.create_task(
                self._every(self.config.predicted_ttl_ms / 2000, self.book.renew_predicted)
            ),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.index.close()
        try:
            if self.redis_ok:
                await self.index.retract()
        except RedisError:
            pass
        await self.view.close()
        if self.fast is not None:
            await self.fast.close()
        await self.redis.aclose()

    async def _every(self, interval_s: float, fn) -> None:  # type: ignore[no-untyped-def]
        while True:
            await asyncio.sleep(interval_s)
            try:
                await fn()
            except Exception:  # a background loop must survive anything
                log.exception("background task %s failed", getattr(fn, "__name__", fn))

    async def refresh(self) -> None:
        """Re-read the live replicas (and detect Redis coming back)."""
        self.book.predicted.prune()
        try:
            matches = await self.index.refresh()
        except (RedisError, OSError) as exc:
            self._set_redis(False, exc)
            return
        self._set_redis(True)
        self._apply(matches)

    async def flush_inflight(self) -> None:
        tokens = {rid: h.inflight_tokens for rid, h in self.view.handles.items()}
        for rid, value in tokens.items():
            self.metrics.inflight.labels(rid).set(value)
        if not self.redis_ok:
            return
        try:
            await self.index.publish_inflight(tokens)
        except (RedisError, OSError) as exc:
            self._set_redis(False, exc)

    def _set_redis(self, ok: bool, exc: Exception | None = None) -> None:
        if ok != self.redis_ok:
            if ok:
                log.info("redis reachable: cache-aware routing on")
            else:
                log.warning("redis unreachable (%s): routing least-loaded on the local view", exc)
                # Drop every pooled connection: they all point at the Redis that went away.
                self._spawn(self.redis.connection_pool.disconnect())
        self.redis_ok = ok
        self.metrics.redis_up.set(1 if ok else 0)

    def _apply(self, matches: Sequence[ReplicaMatch]) -> None:
        self.view.apply((m.replica_id, m.lease, m.other_inflight_tokens) for m in matches)
        self.metrics.replicas.set(len(self.view.live()))

    # -- the forwarder's three calls (router/forward.py), kept by the bookkeeper -------------

    def prefilled(self, plan: RoutePlan) -> None:
        """A response came: the prompt is prefilled (``RoutePlan.settle_prefill``, ``settle``)."""
        plan.settle_prefill()
        self.book.settle(plan)

    def finished(self, plan: RoutePlan) -> None:
        """The attempt ended, however: its load goes (``RoutePlan.release``), and ``settle``."""
        plan.release()
        self.book.settle(plan)

    def account(self, plan: RoutePlan) -> None:
        """The bookkeeping a deferred ``route`` left for after the send."""
        self.book.account(plan)

    # -- routing ------------------------------------------------------------------------------

    async def route(
        self,
        request: pb.GenerateRequest,
        exclude: frozenset[str] = frozenset(),
        group: GROUP_KEY | None = None,
        token_ids: list[int] | None = None,
        defer_bookkeeping: bool = False,
        packed_ids: bytes | None = None,
    ) -> RoutePlan:
        """Pick a replica for ``request`` (never one in ``exclude``; only ``group`` if set).

        ``token_ids``: its ``token_ids.ids`` as a list, if the caller has already read them
        (``packed_ids``: and packed, ``prefixmesh.hashing.token_bytes``).
        Everything a later decision reads (in-flight tokens, predicted entries, the recent
        requests) is updated before this returns; with ``defer_bookkeeping`` the rest
        (metrics, miss attribution, the predicted entries' Redis write) waits for
        ``account(plan)``, which the caller runs once the request is on its way to the
        replica, so that it overlaps the replica's work instead of preceding it."""
        tokens = tokenize(request, self.view, token_ids, packed_ids)
        matches, lookup_s = await self._lookup(tokens, group)
        handles, matches = self._routable(matches, exclude, group)
        primary = self._primary_group(handles, tokens)
        ids = tokens.ids_by_group.get(primary) if primary else None
        hashes = tokens.hashes_by_group.get(primary, []) if primary else []
        sampling = request.sampling
        # An explicit 0 (which the replica rejects) counts as the default, like an unset one.
        default = self.config.default_max_tokens
        decode = (requested_max_tokens(sampling, default) or default) * requested_n(sampling)
        candidates, best, runner_up, tied = self._candidates(handles, matches, hashes, primary)
        # Tie-break key: the deepest block some replica holds (the same for every request and
        # router sharing that prefix, distinct between prefixes), else the whole prompt.
        if hashes:
            affinity = hashes[best - 1] if best else hashes[-1]
        else:
            affinity = fallback_affinity(ids, request.request_id)
        route_req = RouteRequest(
            prompt_tokens=len(ids) + len(request.resume_token_ids) if ids else 0,
            num_blocks=len(hashes),
            block_size=primary[1] if primary else 0,
            decode_tokens=decode,
            affinity=affinity,
        )
        policy = self.policy if matches is not None else self._fallback
        decision = policy.choose(route_req, candidates)
        if matches is None:  # no cache index: whatever the policy thought, this is a fallback
            decision = decision._replace(outcome=FALLBACK)
        handle = self.view.handles[decision.replica_id]
        for chosen in candidates:  # the policy chose one of them: the loop breaks
            if chosen.replica_id == decision.replica_id:
                break
        # Blocks the replica does not report yet: it is about to compute them.
        new = self.book.commit(handle, decision, hashes[chosen.cached_blocks :])
        self.recent.add(handle.replica_id)
        if hashes:  # of the primary group: what its pools take in
            self.content.add(handle.replica_id, hashes)
        plan = RoutePlan(
            handle=handle,
            decision=decision,
            prompt_ids=ids,
            decode_tokens=decode,
            held_tokens=decision.weight_tokens,
        )
        self.book.hold(plan, new)  # renewed until the first token, then settled
        plan.fetch_hint = self._fetch_hint(candidates, chosen)
        # The most another replica matches: the deepest, unless only the chosen one has it.
        promised = decision.matched_blocks  # the chosen one's (policy.decide)
        elsewhere = best if promised < best or tied > 1 else runner_up
        plan.unaccounted = Bookkeeping(
            lookup_s, hashes, route_req.prompt_tokens, route_req.block_size,
            promised, elsewhere, new if matches is not None else [],
        )  # fmt: skip
        if not defer_bookkeeping:
            self.book.account(plan)
        return plan

    def _candidates(
        self, handles, matches, hashes: list[BlockHash], primary: GROUP_KEY | None
    ) -> tuple[list[Candidate], int, int, int]:
        """Each candidate built once, in one pass that also keeps what the rest of the decision
        reads of them: the most leading blocks any matches, the most below that (the miss
        attribution's "elsewhere" for the chosen one), and how many match the most."""
        candidates: list[Candidate] = []
        best = runner_up = tied = 0
        for h in handles:
            c = self._candidate(h, matches, hashes, primary)
            candidates.append(c)
            matched = c.matched_blocks
            if matched > best:
                best, runner_up, tied = matched, best, 1
            elif matched == best:
                tied += 1
            elif matched > runner_up:
                runner_up = matched
        return candidates, best, runner_up, tied

    async def _lookup(
        self, tokens: PromptTokens, group: GROUP_KEY | None
    ) -> tuple[dict[str, ReplicaMatch] | None, float | None]:
        """Each live replica's match by id, and the lookup's time (None, None: no cache index,
        Redis is unreachable)."""
        if not self.redis_ok:
            return None, None
        groups = [
            HashGroup(g[0], g[1], h)
            for g, h in tokens.hashes_by_group.items()
            if group in (None, g)
        ]
        start = time.perf_counter()
        try:
            found = await self.index.lookup(groups)
        except (RedisError, OSError) as exc:
            self._set_redis(False, exc)
            return None, None
        lookup_s = time.perf_counter() - start
        if self.mirror is None:  # fresh leases; the mirror's are the refresh's
            self._apply(found)
        return {m.replica_id: m for m in found}, lookup_s

    def _routable(
        self,
        matches: dict[str, ReplicaMatch] | None,
        exclude: frozenset[str],
        group: GROUP_KEY | None,
    ) -> tuple[list[ReplicaHandle], dict[str, ReplicaMatch] | None]:
        """The replicas this request may go to, and the matches (None when they are not from
        the lookup: routing falls back to least-loaded)."""
        handles = self.view.live() if matches is not None else self.view.known()
        handles = [
            h for h in handles
            if h.replica_id not in exclude and (group is None or h.lease.group == group)
        ]  # fmt: skip
        if not handles and matches is not None:
            # Redis lost every lease (e.g. it restarted and replicas have not re-registered).
            handles = [h for h in self.view.known() if h.replica_id not in exclude]
            matches = None
        if not handles:
            raise NoReplicaError("no live replica (none registered in Redis, or all failed)")
        return handles, matches

    def _fetch_hint(
        self, candidates: Sequence[Candidate], chosen: Candidate
    ) -> pb.FetchHint | None:
        source = fetch_source(candidates, chosen)
        if source is None:
            return None
        return pb.FetchHint(
            replica_id=source.replica_id,
            address=self.view.handles[source.replica_id].lease.address,
            num_blocks=source.cached_blocks,
        )

    @staticmethod
    def _primary_group(handles: Sequence[ReplicaHandle], tokens: PromptTokens) -> GROUP_KEY | None:
        if len(tokens.ids_by_group) == 1:  # one model and block size: the usual cluster
            (only,) = tokens.ids_by_group
            return only if any(h.lease.group == only for h in handles) else None
        counts: dict[GROUP_KEY, int] = {}
        for h in handles:
            if h.lease.group in tokens.ids_by_group:
                counts[h.lease.group] = counts.get(h.lease.group, 0) + 1
        return max(counts, key=lambda g: counts[g]) if counts else None

    def _candidate(
        self,
        handle: ReplicaHandle,
        matches: dict[str, ReplicaMatch] | None,
        hashes: Sequence[BlockHash],
        primary: GROUP_KEY | None,
    ) -> Candidate:
        rid, lease = handle.replica_id, handle.lease
        match = matches.get(rid) if matches else None
        same_group = lease.group == primary
        cached = match.cached_blocks if match and same_group else 0
        predicted = match.predicted_blocks if match and same_group else 0
        if same_group and rid in self.book.predicted:
            predicted = max(predicted, self.book.predicted.leading(rid, hashes, cached))
        other = match.other_inflight_tokens if match else handle.other_inflight_tokens
        return Candidate(
            rid, cached, predicted, max(0, handle.inflight_tokens) + other, lease.queued_tokens,
            self.recent.count(rid), lease.fetch_cost if lease.fetch_cost >= 0 else None,
            lease.empty_blocks, self.content.count(rid) if same_group else None,
        )  # fmt: skip

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
