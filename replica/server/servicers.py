"""The gRPC servicers of a replica: ``Generator.Generate`` and the ``Replica`` admin service.

They hold no state of their own and never see the ``ReplicaServer``: they are given the engine
loop (to run requests), the admission gate (waiting queue, in-flight count, draining), the
metrics, and ``ServedModel`` (what this replica serves, fixed once its port is bound).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import grpc

from prefixmesh.hashing import HASH_SCHEME
from prefixmesh.limits import RequestLimits, abort_busy, check_request
from prefixmesh.tenants import TenantBusy, TenantLimiter, Ticket, tenant_of_call
from prefixmesh.tokenizer import Tokenizer
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from replica.fetch.holder import BlockService
from replica.server.admission import Admission
from replica.server.engine_loop import EngineFailure, EngineLoop, RequestHandle
from replica.server.metrics import ReplicaMetrics
from replica.server.request_mapping import MappedRequest, engine_request, response

if TYPE_CHECKING:
    from replica.engine import EngineStats, LLMEngine
    from replica.fetch.client import PeerFetcher

log = logging.getLogger(__name__)
Ctx = grpc.aio.ServicerContext  # every servicer method gets one


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What one replica serves: its id and its engine's model, as clients and routers see it."""

    replica_id: str
    model_id: str
    block_size: int
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer
    kernel_build: str = ""  # kernels.cpu_ops.describe(), "triton ...": what runs the model
    dtype: str = ""


def load_message(stats: EngineStats, replica_id: str) -> pb.ReplicaLoad:
    s = stats
    return pb.ReplicaLoad(
        replica_id=replica_id, running=s.running,
        waiting=s.waiting, kv_usage=s.kv_usage,
        queued_tokens=s.queued_tokens, num_blocks=s.num_blocks, free_blocks=s.free_blocks,
    )  # fmt: skip


class GeneratorService(pb_grpc.GeneratorServicer):
    """``Generate``: one message per engine step per sample, usage on each sample's last."""

    def __init__(
        self,
        loop: EngineLoop,
        admission: Admission,
        model: ServedModel,
        metrics: ReplicaMetrics,
        limits: RequestLimits,
        tenants: TenantLimiter | None = None,
        fetcher: PeerFetcher | None = None,
    ) -> None:
        self.loop = loop
        self.admission = admission
        self.model = model
        self.metrics = metrics
        self.limits = limits  # prefixmesh/limits.py: bounded requests
        self.tenants = tenants  # prefixmesh/tenants.py: one tenant cannot starve others
        self.fetcher = fetcher  # replica/fetch/client.py: a peer's KV instead of prefill

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: Ctx
    ) -> AsyncIterator[pb.GenerateResponse]:
        admission, loop = self.admission, self.loop
        arrival = time.monotonic()
        if admission.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica is shutting down")
        engine_id = uuid.uuid4().hex  # client ids may collide; the engine's must not
        try:
            check_request(request, self.limits)  # prefixmesh/limits.py: bounded requests
            req = engine_request(
                request, self.model.tokenizer, self.model.vocab_size,
                request_id=engine_id, arrival_time=arrival, max_model_len=self.model.max_model_len,
            )  # fmt: skip
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if admission.queue_full():
            await abort_busy(
                context,
                f"waiting queue is full ({admission.max_queue} requests); retry elsewhere",
                self.limits.retry_after_s,
            )
        tenant = tenant_of_call(request.cache_salt, context, forwarded=True)
        req.engine.tenant = tenant  # whom fair scheduling charges (replica/tenant_share.py)
        ticket = await self._tenant_ticket(tenant, req, context)
        client_id = request.request_id or uuid.uuid4().hex
        admission.enter()
        waiting, handle, done = True, None, False
        try:
            req.num_fetched_tokens = await self._fetch(request, req)
            try:
                handle = await loop.submit(req.engine)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            stream = self._stream(handle, req, client_id, arrival, context)
            async for msg in stream:
                if waiting:
                    waiting = False
                    admission.first_output()
                    if ticket is not None:
                        ticket.started()
                yield msg
            done = True
        finally:
            if ticket is not None:
                ticket.close()
            if handle is not None and not done:
                loop.abort(engine_id)  # cancelled, deadline expired or failed: free blocks
            loop.release(engine_id)
            admission.leave(still_waiting=waiting)

    async def _fetch(self, request: pb.GenerateRequest, req: MappedRequest) -> int:
        """Leading prompt tokens fetched from a peer (0 when none is, or on any failure:
        the engine then prefills them; a fetch never fails the request)."""
        if self.fetcher is None:
            return 0
        hint = request.fetch_hint if request.HasField("fetch_hint") else None
        try:
            return await self.fetcher.fetch(req.engine, hint)
        except Exception:
            log.exception("fetch from a peer failed; prefilling instead")
            return 0

    async def _tenant_ticket(self, tenant: str, req: MappedRequest, context: Ctx) -> Ticket | None:
        """The tenant's admission (None without tenant caps); over its cap: RESOURCE_EXHAUSTED."""
        if self.tenants is None:
            return None
        try:
            ticket = self.tenants.admit(tenant)
            ticket.queue_tokens(len(req.prompt_token_ids))
        except TenantBusy as exc:
            await abort_busy(context, str(exc), self.limits.retry_after_s)
        return ticket

    async def _stream(
        self,
        handle: RequestHandle,
        req: MappedRequest,
        client_id: str,
        arrival: float,
        context: Ctx,
    ) -> AsyncIterator[pb.GenerateResponse]:
        metrics, replica_id = self.metrics, self.model.replica_id
        remaining = req.engine.params.n
        first_token_at: float | None = None
        last_token_at: dict[int, float] = {}
        while remaining:
            out = await handle.queue.get()
            if isinstance(out, EngineFailure):
                await context.abort(grpc.StatusCode.INTERNAL, str(out))
            now = time.monotonic()
            if out.new_token_ids:
                if first_token_at is None:
                    first_token_at = now
                    metrics.time_to_first_token.observe(now - arrival)
                    scheduled = handle.scheduled_at or now
                    metrics.queue_time.observe(max(0.0, scheduled - arrival))
                    self._record_prefill(
                        out.num_prompt_tokens - out.num_cached_tokens, now - scheduled
                    )
                previous = last_token_at.get(out.index)
                if previous is not None:
                    metrics.inter_token_latency.observe(now - previous)
                last_token_at[out.index] = now
            if out.finished:
                remaining -= 1
            yield response(out, client_id, replica_id, req)
        metrics.e2e_latency.observe(time.monotonic() - arrival)

    def _record_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill's speed, for the fetch-or-recompute choice (long ones only: short ones
        are mostly step overhead)."""
        if self.fetcher is not None and tokens >= 4 * self.model.block_size:
            self.fetcher.cost.record_prefill(tokens, seconds)


class ReplicaService(pb_grpc.ReplicaServicer):
    """Load, stats, model info (tokenizer files) and the exact cache state for routers/tests."""

    def __init__(
        self,
        loop: EngineLoop,
        admission: Admission,
        model: ServedModel,
        epoch: Callable[[], str],
        blocks: BlockService | None = None,
        fetcher: PeerFetcher | None = None,
    ) -> None:
        self.loop = loop
        self.admission = admission
        self.model = model
        self.epoch = epoch  # the Redis lease's epoch ("" without Redis)
        self.blocks = blocks  # FetchBlocks (replica/fetch/holder.py)
        self.fetcher = fetcher  # only read for its counts

    async def GetLoad(self, request: pb.Empty, context: Ctx) -> pb.ReplicaLoad:  # noqa: N802
        return load_message(self.loop.stats, self.model.replica_id)

    async def GetStats(self, request: pb.Empty, context: Ctx) -> pb.ReplicaStats:  # noqa: N802
        s, model = self.loop.stats, self.model
        return pb.ReplicaStats(
            load=load_message(s, model.replica_id),
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            preemptions=s.preemptions,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            finished_by_reason=dict(s.finished_by_reason),
            model=model.model_id,
            block_size=model.block_size,
            hash_scheme=HASH_SCHEME,
            epoch=self.epoch(),
            cached_blocks=s.cached_blocks,
            fetched_tokens=self.fetcher.fetched_tokens if self.fetcher else 0,
            blocks_served=self.blocks.blocks_served if self.blocks else 0,
            **asdict(s.preempt),
        )

    async def GetModelInfo(self, request: pb.Empty, context: Ctx) -> pb.ModelInfo:  # noqa: N802
        model = self.model
        return pb.ModelInfo(
            model=model.model_id,
            block_size=model.block_size,
            hash_scheme=HASH_SCHEME,
            max_model_len=model.max_model_len,
            tokenizer_json=model.tokenizer.tokenizer_json,
            tokenizer_config_json=model.tokenizer.tokenizer_config_json,
            replica_id=model.replica_id,
            kernel_build=model.kernel_build,
            dtype=model.dtype,
        )

    async def GetCacheState(self, request: pb.Empty, context: Ctx) -> pb.CacheState:  # noqa: N802
        def inspect(engine: LLMEngine) -> tuple[set[bytes], str, EngineStats]:
            try:
                engine.check_integrity()
                error = ""
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}" or "integrity check failed"
            return engine.cached_block_hashes(), error, engine.get_stats()

        hashes, error, s = await self.loop.call(inspect)
        return pb.CacheState(
            replica_id=self.model.replica_id,
            block_hashes=sorted(hashes),
            integrity_ok=not error,
            integrity_error=error,
            num_blocks=s.num_blocks,
            free_blocks=s.free_blocks,
            used_blocks=s.num_blocks - s.free_blocks,
            inflight_requests=self.admission.num_inflight,
        )

    async def FetchBlocks(  # noqa: N802
        self, request: pb.FetchBlocksRequest, context: Ctx
    ) -> AsyncIterator[pb.KVBlock]:
        if self.blocks is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this replica serves no KV blocks")
        if self.admission.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica is shutting down")
        async for block in self.blocks.stream(request, context):
            yield block
