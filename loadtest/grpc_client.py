"""``GenerateClient`` over ``prefixmesh.v1.Generator.Generate`` (router or replica)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc

from loadtest.client import Chunk, ClientError, GenerateClient
from loadtest.request import LoadRequest
from prefixmesh.tls import aio_channel
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

_MAX_MESSAGE = 64 * 1024 * 1024


def channel_options(index: int) -> list[tuple[str, object]]:
    # A local subchannel pool gives each channel of the pool its own TCP connection (otherwise
    # gRPC shares one connection among channels with equal arguments).
    return [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_send_message_length", _MAX_MESSAGE),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.loadtest_channel", index),
    ]


def build_request(request: LoadRequest) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        request_id=f"loadtest-{request.index}",
        sampling=pb.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=request.cache_salt,
    )
    if request.text is None:
        msg.token_ids.ids.extend(request.token_ids)
    else:
        msg.text = request.text
    return msg


class GrpcClient(GenerateClient):
    """A small pool of ``grpc.aio`` channels shared by all requests (round robin)."""

    def __init__(
        self, target: str, channels: int = 1, api_key: str = "", tls_files: Any = None
    ) -> None:
        if channels < 1:
            raise ValueError(f"channels must be >= 1 (got {channels})")
        self.target = target
        # A router started with --api-key wants it as gRPC metadata (prefixmesh.auth).
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channels = [
            aio_channel(target, tls_files, options=channel_options(i)) for i in range(channels)
        ]
        self._stubs = [pb_grpc.GeneratorStub(c) for c in self._channels]
        self._next = itertools.cycle(range(channels))

    async def wait_ready(self, timeout: float) -> None:
        import asyncio

        try:
            await asyncio.wait_for(
                asyncio.gather(*(c.channel_ready() for c in self._channels)), timeout
            )
        except asyncio.TimeoutError as e:
            raise ClientError("UNAVAILABLE", f"{self.target} not ready after {timeout}s") from e

    async def stream(self, request: LoadRequest, timeout: float | None) -> AsyncIterator[Chunk]:
        stub = self._stubs[next(self._next)]
        call = stub.Generate(build_request(request), timeout=timeout, metadata=self._metadata)
        try:
            async for msg in call:
                chunk = Chunk(num_tokens=len(msg.token_ids), replica_id=msg.replica_id)
                if msg.finish_reason:
                    chunk.finish_reason = msg.finish_reason
                    if msg.HasField("usage"):
                        chunk.prompt_tokens = msg.usage.prompt_tokens
                        chunk.completion_tokens = msg.usage.completion_tokens
                        chunk.cached_tokens = msg.usage.cached_tokens
                        chunk.fetched_tokens = msg.usage.fetched_tokens
                yield chunk
        except grpc.aio.AioRpcError as e:
            raise ClientError(e.code().name, e.details() or "") from e
        finally:
            call.cancel()

    async def close(self) -> None:
        for c in self._channels:
            await c.close()
