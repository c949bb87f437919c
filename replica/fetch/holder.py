"""``Replica.FetchBlocks``, the holder's side of a KV transfer: stream the leading blocks of a
peer's prompt that this replica holds, pinned while they stream.

The pin is taken on the engine thread (a command between two steps); the KV is read off it
(pinned, cached blocks are never written or reallocated, ``replica/fetch/transfer.py``), a few
blocks at a time in a worker thread so neither the engine nor the event loop waits on the copy.
The pin is released however the stream ends: completed, cancelled by the peer, or failed.
The API key is checked by the server's interceptor, as for every other call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from prefixmesh.hashing import HASH_SCHEME
from proto import prefixmesh_pb2 as pb
from replica.fetch.layout import KVLayout
from replica.fetch.transfer import read_blocks

if TYPE_CHECKING:
    import torch

    from replica.server.engine_loop import EngineLoop
    from replica.server.metrics import ReplicaMetrics

READ_CHUNK = 8  # blocks per read off the engine thread
MAX_HASHES = 65536  # a 1M-token prompt of 16-token blocks


class BlockService:
    """Serves ``FetchBlocks`` for one replica."""

    def __init__(
        self,
        loop: EngineLoop,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layout: KVLayout,
        metrics: ReplicaMetrics | None = None,
    ) -> None:
        self.loop = loop
        self.kv_caches = kv_caches
        self.layout = layout
        self.metrics = metrics
        self.blocks_served = 0  # since start, for GetStats

    async def check(self, request: pb.FetchBlocksRequest, context: grpc.aio.ServicerContext):
        """Abort with INVALID_ARGUMENT / FAILED_PRECONDITION when the request cannot be served."""
        if not request.model or not request.dtype or request.block_size < 1:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "model, dtype and block_size (>= 1) are required: the holder checks its KV "
                "layout against the asker's",
            )
        if len(request.block_hashes) > MAX_HASHES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block_hashes holds at most {MAX_HASHES} hashes (got {len(request.block_hashes)})",
            )
        bad = next((i for i, h in enumerate(request.block_hashes) if len(h) != 16), None)
        if bad is not None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"block_hashes[{bad}] must be 16 bytes"
            )
        if request.start < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"start must be >= 0 (got {request.start})"
            )
        problem = self.layout.mismatch(
            request.model, request.dtype, request.block_size, request.hash_scheme or HASH_SCHEME
        )
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)

    async def stream(
        self, request: pb.FetchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVBlock]:
        await self.check(request, context)
        hashes = list(request.block_hashes)
        salt = request.cache_salt
        if request.any_order:  # warm start: whole chains of the wanted blocks, parents first
            pinned = await self.loop.call_now(lambda e: e.pin_chains(hashes, salt, len(hashes)))
        else:
            pinned = await self.loop.call_now(lambda e: e.pin_prefix(hashes, salt, request.start))
        try:
            for i in range(0, len(pinned.blocks), READ_CHUNK):
                chunk = pinned.blocks[i : i + READ_CHUNK]
                data = await asyncio.to_thread(read_blocks, self.kv_caches, chunk)
                for j, (keys, values) in enumerate(data):
                    yield pb.KVBlock(
                        block_hash=pinned.hashes[i + j],
                        token_ids=pinned.token_ids[i + j],
                        keys=keys,
                        values=values,
                        parent_hash=(pinned.parents[i + j] or b"") if pinned.parents else b"",
                    )
                self.blocks_served += len(chunk)
                if self.metrics is not None:
                    self.metrics.blocks_served.inc(len(chunk))
        finally:
            self.loop.post(lambda e: e.unpin(pinned.pin_id))
