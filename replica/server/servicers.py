"""The gRPC servicers of a replica: ``Generator.Generate`` and the ``Replica`` admin service.

They hold no state of their own: everything lives on the ``ReplicaServer`` they serve.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from prefixmesh.hashing import HASH_SCHEME
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from replica.server.engine_loop import EngineFailure, RequestHandle
from replica.server.request_mapping import EngineRequest, engine_request, response

if TYPE_CHECKING:
    from replica.server.server import ReplicaServer


class GeneratorService(pb_grpc.GeneratorServicer):
    """``Generate``: one message per engine step per sample, usage on each sample's last."""

    def __init__(self, server: ReplicaServer) -> None:
        self.srv = server

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        srv = self.srv
        arrival = time.monotonic()
        if srv.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica is shutting down")
        try:
            req = engine_request(request, srv.engine.tokenizer, srv.vocab_size)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if srv.num_waiting >= srv.config.max_queue:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"waiting queue is full ({srv.config.max_queue} requests); retry elsewhere",
            )
        client_id = request.request_id or uuid.uuid4().hex
        engine_id = uuid.uuid4().hex  # client ids may collide; the engine's must not
        srv.request_started()
        srv.num_waiting += 1
        waiting, handle, done = True, None, False
        try:
            try:
                handle = await srv.loop.submit(
                    engine_id,
                    req.prompt_token_ids,
                    req.params,
                    priority=req.priority,
                    cache_salt=req.cache_salt,
                    arrival_time=arrival,
                    unsent_text=req.unsent_text,
                )
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            stream = self._stream(handle, req, client_id, arrival, context)
            async for msg in stream:
                if waiting:
                    waiting = False
                    srv.num_waiting -= 1
                yield msg
            done = True
        finally:
            if waiting:
                srv.num_waiting -= 1
            if handle is not None and not done:
                srv.loop.abort(engine_id)  # cancelled, deadline expired or failed: free blocks
            srv.loop.release(engine_id)
            srv.request_ended()

    async def _stream(
        self,
        handle: RequestHandle,
        req: EngineRequest,
        client_id: str,
        arrival: float,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateResponse]:
        srv, metrics = self.srv, self.srv.metrics
        remaining = req.params.n
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
                previous = last_token_at.get(out.index)
                if previous is not None:
                    metrics.inter_token_latency.observe(now - previous)
                last_token_at[out.index] = now
            if out.finished:
                remaining -= 1
            yield response(out, client_id, srv.replica_id, req)
        metrics.e2e_latency.observe(time.monotonic() - arrival)


class ReplicaService(pb_grpc.ReplicaServicer):
    """Load, stats, model info (tokenizer files) and the exact cache state for routers/tests."""

    def __init__(self, server: ReplicaServer) -> None:
        self.srv = server

    async def GetLoad(self, request: pb.Empty, context: Any) -> pb.ReplicaLoad:  # noqa: N802
        return self.srv.load()

    async def GetStats(self, request: pb.Empty, context: Any) -> pb.ReplicaStats:  # noqa: N802
        srv = self.srv
        s = srv.loop.stats
        return pb.ReplicaStats(
            load=srv.load(),
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            preemptions=s.preemptions,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            finished_by_reason=dict(s.finished_by_reason),
            model=srv.engine.model_id,
            block_size=srv.engine.block_size,
            hash_scheme=HASH_SCHEME,
            epoch=srv.publisher.epoch if srv.publisher else "",
            cached_blocks=s.cached_blocks,
        )

    async def GetModelInfo(self, request: pb.Empty, context: Any) -> pb.ModelInfo:  # noqa: N802
        srv = self.srv
        tok = srv.engine.tokenizer
        return pb.ModelInfo(
            model=srv.engine.model_id,
            block_size=srv.engine.block_size,
            hash_scheme=HASH_SCHEME,
            max_model_len=srv.engine.max_model_len,
            tokenizer_json=tok.tokenizer_json,
            tokenizer_config_json=tok.tokenizer_config_json,
            replica_id=srv.replica_id,
        )

    async def GetCacheState(self, request: pb.Empty, context: Any) -> pb.CacheState:  # noqa: N802
        def inspect(engine: Any) -> tuple[set[bytes], str, Any]:
            try:
                engine.check_integrity()
                error = ""
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}" or "integrity check failed"
            return engine.cached_block_hashes(), error, engine.get_stats()

        hashes, error, s = await self.srv.loop.call(inspect)
        return pb.CacheState(
            replica_id=self.srv.replica_id,
            block_hashes=sorted(hashes),
            integrity_ok=not error,
            integrity_error=error,
            num_blocks=s.num_blocks,
            free_blocks=s.free_blocks,
            used_blocks=s.num_blocks - s.free_blocks,
            inflight_requests=self.srv.num_inflight,
        )
