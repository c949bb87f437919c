"""Stream one request through a replica, with retries and mid-stream failover.

- A replica that fails before anything was streamed to the client (connection refused, queue
  full, dead process) is excluded and the request is routed again, unchanged.
- A replica that fails mid-stream is replaced by another one that *resumes*: the prompt goes as
  ``token_ids`` and the tokens generated so far as ``resume_token_ids``; the replica continues
  from there (counting them toward ``max_tokens``) and the client's stream simply goes on.
  With ``n > 1`` each unfinished sample is resumed on its own as an ``n = 1`` request and its
  responses keep their original ``index``. Greedy resumes reproduce an undisturbed run
  exactly; sampled ones continue validly but from a different random stream. The resuming
  replica's detokenizer takes the resumed tokens as left context, so a character split across
  the boundary still comes out whole; invalid UTF-8 byte runs may show a different number of
  U+FFFD characters (the detokenizer's own contract).
- A replica holds back text that may start a stop string, so when it dies the client can have
  a token's id but not yet all its text. The router counts the characters it forwarded per
  sample and sends them as ``resume_text_chars``: the resuming replica streams the rest of the
  resumed tokens' text first, through its stop-string matcher, so the client's text is that of
  an undisturbed run (and a stop string across the resume point still stops it). A client's
  own ``resume_token_ids`` without ``resume_text_chars`` keep their old meaning (all their text
  was received): a router resume of such a request cannot count their text, so it leaves the
  field unset and text held back at that moment is lost.
- The final message's usage is fixed up after a resume so it counts the original prompt and
  every generated token. A sample whose tokens all arrived but whose final message was lost is
  finished by the router (``finish_reason = "length"``) instead of being resumed.
- Deadlines pass through (the remaining time becomes the upstream timeout); a client
  cancellation cancels the upstream call.
- Every upstream call carries the router's replica API key. A replica that refuses it
  (UNAUTHENTICATED) is misconfigured, not failing: the client gets UNAUTHENTICATED with a
  message naming the router's flags, with no retry, and the replica stays in the routing set.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import grpc

from prefixmesh.hashing import token_bytes
from prefixmesh.limits import RequestLimits, abort_busy, check_request, retry_metadata
from prefixmesh.request_defaults import requested_max_tokens, requested_n
from prefixmesh.tenants import (
    DEFAULT_TENANT,
    TENANT_METADATA,
    TenantBusy,
    TenantLimiter,
    Ticket,
    tenant_of_call,
)
from proto import prefixmesh_pb2 as pb
from router.discovery import GROUP_KEY, ReplicaHandle
from router.routing import NoReplicaError, RoutePlan, Router

log = logging.getLogger("prefixmesh.router")

# Codes that mean "this replica could not do it", not "this request is wrong".
_REPLICA_FAILURES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}
_BUSY = {grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass(slots=True)
class _Attempt:
    """One upstream call: the request sent and how its sample indexes map to the client's."""

    request: pb.GenerateRequest
    samples: list[int]  # client sample index of upstream index i
    plan: RoutePlan | None = None


@dataclass(slots=True)
class _Progress:
    generated: dict[int, list[int]] = field(default_factory=dict)
    text_chars: dict[int, int] = field(default_factory=dict)  # characters sent to the client
    client_resumed: int = 0  # the client's own resume_token_ids: they count as completion
    finished: set[int] = field(default_factory=set)
    streamed: bool = False


class Forwarder:
    """Runs ``Generator.Generate`` for the router's servicer."""

    def __init__(
        self,
        router: Router,
        limits: RequestLimits | None = None,
        tenants: TenantLimiter | None = None,
    ) -> None:
        self.router = router
        self.metrics = router.metrics
        self.limits = limits or RequestLimits()  # prefixmesh/limits.py
        self.tenants = tenants  # prefixmesh/tenants.py (None: no tenant caps)
        # Ids for requests that come without one: a random prefix per router and a counter,
        # 32 hex digits like a random id, unique across routers without a syscall per request.
        self._id_prefix = os.urandom(8).hex()
        self._id_count = itertools.count()

    async def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Bounds first (the replicas check them too, but the router need not route a request
        they will refuse), then the tenant's share, then the stream.

        A coroutine that writes each message (gRPC's reader/writer style), down to the loop
        over the replica's stream: no async generator between the replica's stream and the
        client's."""
        # Read once: each read of a repeated field builds every element again (~20 us per 500
        # token ids); the bounds check and the routing share this list. Packed once too, as
        # the block hashes read them: unsigned, so a negative id fails here, and the bounds
        # check need not scan the list for one (it names it when the packing fails).
        ids = packed = None
        if request.WhichOneof("input") == "token_ids":
            ids = request.token_ids.ids[:]
            try:
                packed = token_bytes(ids)
            except OverflowError:
                pass
        try:
            check_request(request, self.limits, ids, prompt_ids_checked=packed is not None)
        except ValueError as exc:
            self.metrics.error("INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        ticket: Ticket | None = None
        metadata = self.router.view.metadata
        if self.tenants is not None or not request.cache_salt:  # else the salt is the tenant
            tenant = tenant_of_call(request.cache_salt, context)
            metadata = upstream_metadata(metadata, tenant, request.cache_salt)
            if self.tenants is not None:
                try:
                    ticket = self.tenants.admit(tenant)
                except TenantBusy as exc:
                    self.metrics.error("RESOURCE_EXHAUSTED")
                    await abort_busy(context, str(exc), self.limits.retry_after_s)
        try:
            await self._generate(request, context, ticket, ids, metadata, packed)
        finally:
            if ticket is not None:
                ticket.close()

    async def _generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
        ticket: Ticket | None,
        token_ids: list[int] | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
        packed_ids: bytes | None = None,
    ) -> None:
        arrival = time.perf_counter()
        if not request.request_id:
            request.request_id = f"{self._id_prefix}{next(self._id_count):016x}"
        n = requested_n(request.sampling)
        progress = _Progress(client_resumed=len(request.resume_token_ids))
        queue = [_Attempt(request, list(range(n)))]
        excluded: set[str] = set()
        tries = failures = 0
        busy = ""  # the last RESOURCE_EXHAUSTED a replica answered
        prompt_ids: list[int] | None = None
        group = None
        write = context.write
        while queue:
            attempt = queue[0]
            tries += 1
            first = attempt.request is request
            prompt = (token_ids, packed_ids) if first else (None, None)
            plan = await self._route(attempt, frozenset(excluded), group, busy, context, *prompt)
            attempt.plan = plan
            if prompt_ids is None and first:
                prompt_ids = plan.prompt_ids
            if ticket is not None and tries == 1:
                await self._queue_tokens(ticket, plan, context)
            handle = plan.handle
            call = self._call(attempt, plan, context, arrival if tries == 1 else None, metadata)
            try:
                async for resp in call:
                    ttft = None if progress.streamed else self._first(progress, ticket, arrival)
                    self.router.prefilled(plan)
                    msg = self._observe(resp, attempt, progress, prompt_ids)
                    try:
                        await write(msg)
                    finally:  # counted once the client has it (or has gone): off its latency
                        if ttft is not None:
                            self.metrics.ttft.observe(ttft)
                        if msg.finish_reason:
                            self._count_finished(msg, plan)
                queue.pop(0)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                failures += 1
                if code in _BUSY:
                    busy = (exc.details() or code.name).split("; retry after")[0]
                await self._abort_if_final(exc, handle, failures, context)
                if code is grpc.StatusCode.UNAVAILABLE:
                    self.router.view.mark_dead(handle.replica_id)
                excluded.add(handle.replica_id)
                if not _started(attempt, progress):
                    self.metrics.retried(handle.replica_id)
                    log.info("retry %s elsewhere (%s on %s)", request.request_id, code.name,
                             handle.replica_id)  # fmt: skip
                    continue
                if prompt_ids is None:
                    self.metrics.error(code.name)
                    await context.abort(code, "replica failed mid-stream and the router could "
                                        "not tokenize the prompt to resume it")  # fmt: skip
                self.metrics.failed_over(handle.replica_id)
                log.info("resume %s elsewhere (%s on %s)", request.request_id, code.name,
                         handle.replica_id)  # fmt: skip
                group = handle.lease.group
                queue.pop(0)
                finals, resumes = self._resumes(
                    request, attempt, progress, prompt_ids, handle.replica_id
                )
                for msg in finals:
                    await write(msg)
                queue[:0] = resumes
            finally:
                self.router.finished(plan)
                if not call.done():
                    call.cancel()

    async def _route(
        self,
        attempt: _Attempt,
        excluded: frozenset[str],
        group: GROUP_KEY | None,
        busy: str,
        context: grpc.aio.ServicerContext,
        token_ids: list[int] | None = None,
        packed_ids: bytes | None = None,
    ) -> RoutePlan:
        """Route one attempt. No replica left: RESOURCE_EXHAUSTED when the last ones answered
        that they were full (``busy``), overload rather than an outage; UNAVAILABLE otherwise."""
        try:
            return await self.router.route(
                attempt.request, excluded, group, token_ids, True, packed_ids
            )
        except NoReplicaError as exc:
            if busy:  # every replica left was full: overload, not an outage
                self.metrics.error("RESOURCE_EXHAUSTED")
                await abort_busy(context, f"every replica is busy ({busy})",
                                 self.limits.retry_after_s)  # fmt: skip
            self.metrics.error("UNAVAILABLE")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise  # not reached: abort raises

    def _call(
        self,
        attempt: _Attempt,
        plan: RoutePlan,
        context: grpc.aio.ServicerContext,
        arrival: float | None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> grpc.aio.UnaryStreamCall:
        """The upstream call. gRPC sends the request from a task it has just queued; the
        routing's bookkeeping is queued behind that task (``_after_send``), so it overlaps the
        replica's work instead of adding to the client's wait."""
        try:
            return plan.handle.generator.Generate(
                _with_hint(attempt.request, plan), timeout=context.time_remaining(),
                metadata=self.router.view.metadata if metadata is None else metadata,
            )  # fmt: skip
        finally:
            overhead = None if arrival is None else time.perf_counter() - arrival
            asyncio.get_running_loop().call_soon(self._after_send, plan, overhead)

    def _after_send(self, plan: RoutePlan, overhead_s: float | None) -> None:
        """The routing's bookkeeping (``Router.account``) and, for a request's first attempt,
        the time from its arrival to its upstream call."""
        self.router.account(plan)
        if overhead_s is not None:
            self.metrics.overhead.observe(overhead_s)

    @staticmethod
    def _first(progress: _Progress, ticket: Ticket | None, arrival: float) -> float:
        """The stream's first message: its tenant's request has started; returns the TTFT."""
        progress.streamed = True
        if ticket is not None:
            ticket.started()
        return time.perf_counter() - arrival

    async def _queue_tokens(
        self, ticket: Ticket, plan: RoutePlan, context: grpc.aio.ServicerContext
    ) -> None:
        """Count the prompt against its tenant's queued tokens (prefixmesh/tenants.py)."""
        try:
            ticket.queue_tokens(len(plan.prompt_ids or ()))
        except TenantBusy as exc:
            self.router.account(plan)
            self.router.finished(plan)
            self.metrics.error("RESOURCE_EXHAUSTED")
            await abort_busy(context, str(exc), self.limits.retry_after_s)

    async def _abort_if_final(
        self,
        exc: grpc.aio.AioRpcError,
        handle: ReplicaHandle,
        failures: int,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """End the client's call with this failure unless another replica may still serve it."""
        code = exc.code()
        if code is grpc.StatusCode.UNAUTHENTICATED:  # the router's key, not the client's
            self.metrics.error(code.name)
            await context.abort(code, self.router.view.key_refused(handle))
        if code not in _REPLICA_FAILURES | _BUSY or failures >= self.router.config.max_attempts:
            self.metrics.error(code.name)
            if code in _BUSY:  # prefixmesh/limits.py: when to try again
                context.set_trailing_metadata(retry_metadata(self.limits.retry_after_s))
            await context.abort(code, exc.details() or code.name)

    def _resumes(
        self,
        request: pb.GenerateRequest,
        attempt: _Attempt,
        progress: _Progress,
        prompt_ids: list[int],
        failed_replica: str,
    ) -> tuple[list[pb.GenerateResponse], list[_Attempt]]:
        """After a mid-stream failure: the final messages of samples whose tokens all arrived
        (only their last message was lost), and one resume attempt per unfinished sample."""
        budget = requested_max_tokens(request.sampling, self.router.config.default_max_tokens)
        finals: list[pb.GenerateResponse] = []
        resumes: list[_Attempt] = []
        for i in attempt.samples:
            done = progress.generated.get(i, [])
            if i in progress.finished:
                continue
            completion = progress.client_resumed + len(done)
            if completion >= budget:  # only the final message was lost
                finals.append(_final(request, i, failed_replica, prompt_ids, completion))
                progress.finished.add(i)
                continue
            chars = progress.text_chars.get(i, 0)
            resumes.append(_Attempt(_resume_request(request, prompt_ids, done, chars), [i]))
        return finals, resumes

    def _observe(
        self,
        resp: pb.GenerateResponse,
        attempt: _Attempt,
        progress: _Progress,
        prompt_ids: list[int] | None,
    ) -> pb.GenerateResponse:
        """Track progress and fix the message up for the client (index, replica, usage)."""
        plan = attempt.plan
        assert plan is not None
        index = attempt.samples[resp.index] if resp.index < len(attempt.samples) else resp.index
        resp.index = index
        if not resp.replica_id:
            resp.replica_id = plan.handle.replica_id
        progress.generated.setdefault(index, []).extend(resp.token_ids)
        progress.text_chars[index] = progress.text_chars.get(index, 0) + len(resp.text)
        if resp.finish_reason:
            progress.finished.add(index)
            resumed = len(attempt.request.resume_token_ids) > 0
            if resumed and prompt_ids is not None:
                resp.usage.prompt_tokens = len(prompt_ids)
                # As a replica counts them: resumed tokens (the client's own, then ours) are
                # completion tokens, not prompt tokens.
                generated = len(progress.generated[index])
                resp.usage.completion_tokens = progress.client_resumed + generated
                resp.usage.cached_tokens = min(resp.usage.cached_tokens, len(prompt_ids))
        return resp

    def _count_finished(self, resp: pb.GenerateResponse, plan: RoutePlan) -> None:
        """A sample's final message: its replica's hit statistics, and the request's miss
        attribution (once per routed request, on its first finished sample)."""
        prompt_tokens, cached_tokens = resp.usage.prompt_tokens, resp.usage.cached_tokens
        stats = plan.handle.stats
        stats.prompt_tokens += prompt_tokens
        stats.cached_tokens += cached_tokens
        self.metrics.finished(plan.handle.replica_id, prompt_tokens, cached_tokens)
        if plan.misses is not None:
            for kind, n in self.router.attribution.settle(plan.misses, cached_tokens).items():
                self.metrics.blocks_by_kind[kind].inc(n)
            plan.misses = None


def upstream_metadata(
    own: tuple[tuple[str, str], ...] | None, tenant: str, cache_salt: str
) -> tuple[tuple[str, str], ...] | None:
    """An upstream call's metadata: the router's ``own`` (its replica API key), and the tenant
    it counted the request against (``TENANT_METADATA``) where the replica would not find the
    same one itself: behind the router every call carries the router's key, so the replica's
    caps and fair shares would see one tenant. A salt the replica sees, and a call with no key
    at all is the default tenant there too: those go without (prefixmesh/tenants.py)."""
    if cache_salt or (not own and tenant == DEFAULT_TENANT):
        return own
    return (*(own or ()), (TENANT_METADATA, tenant))


def _with_hint(request: pb.GenerateRequest, plan: RoutePlan) -> pb.GenerateRequest:
    """The request with the plan's fetch hint, or none (a copy when it changes).

    A client's own hint is never passed on: the replica would dial the address it names with
    the replicas' API key, which a router's client need not know."""
    if plan.fetch_hint is None and not request.HasField("fetch_hint"):
        return request
    hinted = pb.GenerateRequest()
    hinted.CopyFrom(request)
    hinted.ClearField("fetch_hint")
    if plan.fetch_hint is not None:
        hinted.fetch_hint.CopyFrom(plan.fetch_hint)
    return hinted


def _started(attempt: _Attempt, progress: _Progress) -> bool:
    """Whether the client already received something of this attempt's samples."""
    return any(i in progress.generated or i in progress.finished for i in attempt.samples)


def _final(
    request: pb.GenerateRequest, index: int, replica_id: str, prompt_ids: list[int], completion: int
) -> pb.GenerateResponse:
    """The last message of a sample whose tokens all arrived before its replica died."""
    final = pb.GenerateResponse(
        request_id=request.request_id, index=index, finish_reason="length", replica_id=replica_id
    )
    final.usage.prompt_tokens = len(prompt_ids)
    final.usage.completion_tokens = completion
    return final


def _resume_request(
    request: pb.GenerateRequest, prompt_ids: list[int], generated: list[int], text_chars: int
) -> pb.GenerateRequest:
    """Sample continuation: ``generated`` tokens were forwarded with ``text_chars`` characters."""
    resumed = pb.GenerateRequest()
    resumed.CopyFrom(request)
    resumed.token_ids.ids[:] = prompt_ids  # selects the token_ids branch of the oneof
    resumed.resume_token_ids[:] = list(request.resume_token_ids) + generated
    resumed.sampling.n = 1
    # Unset with the client's own resume tokens means "all of their text was received", a
    # length the router does not know; then it stays unset (old contract).
    if request.HasField("resume_text_chars") or not request.resume_token_ids:
        resumed.resume_text_chars = request.resume_text_chars + text_chars
    return resumed
