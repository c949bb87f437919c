"""The router's request path without per-call extras: the decode guard put on each handler as
it is registered (no server interceptor without an API key), and token ids packed once for the
hashes, which also stands for the bounds check's negative-id scan."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_router_server import cluster

from prefixmesh.grpc_guard import GuardedServer
from prefixmesh.hashing import block_hashes, token_bytes
from prefixmesh.limits import RequestLimits, check_request
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from router.prompt import BlockHashCache

GARBAGE = b"\xff\xfe garbage \x00" * 5


class _Echo(pb_grpc.GeneratorServicer):
    async def Generate(self, request, context):  # noqa: N802
        await context.write(pb.GenerateResponse(request_id=request.request_id))


def test_a_guarded_server_refuses_undecodable_bodies_without_interceptors() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()  # no interceptors at all
        pb_grpc.add_GeneratorServicer_to_server(_Echo(), GuardedServer(server))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                raw = channel.unary_stream(
                    "/prefixmesh.v1.Generator/Generate",
                    request_serializer=lambda b: b,
                    response_deserializer=pb.GenerateResponse.FromString,
                )
                for _ in range(2):
                    good = pb.GenerateRequest(request_id="r").SerializeToString()
                    assert [m.request_id async for m in raw(good, timeout=5)] == ["r"]
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        [m async for m in raw(GARBAGE, timeout=5)]
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                    assert "could not be decoded" in (err.value.details() or "")
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_router_refuses_undecodable_bodies_and_names_negative_ids(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=1) as c:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{c.router.port}")
            raw = channel.unary_stream(
                "/prefixmesh.v1.Generator/Generate",
                request_serializer=lambda b: b,
                response_deserializer=pb.GenerateResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in raw(GARBAGE, timeout=5)]
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            # A negative token id: the packing refuses it, the bounds check names it.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.generate([5, 6, -7, 8])
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "token_ids.ids[2] must be a token id >= 0 (got -7)" in err.value.details()
            assert len(await c.generate(list(range(40)), max_tokens=2)) >= 2
            await channel.close()

    asyncio.run(scenario())


def test_packing_refuses_negative_ids_and_hashes_as_the_list() -> None:
    with pytest.raises(OverflowError):
        token_bytes([1, -1])
    ids = list(range(3, 40))
    cache = BlockHashCache()
    assert cache.block_hashes(ids, 4, "m", None, token_bytes(ids)) == block_hashes(ids, 4, "m")
    assert cache.block_hashes(ids, 4, "m", "t") == block_hashes(ids, 4, "m", "t")
    # With the prompt known to be non-negative the scan is skipped; resume ids are still read.
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), resume_token_ids=[1, -2])
    with pytest.raises(ValueError, match=r"resume_token_ids\[1\]"):
        check_request(request, RequestLimits(), ids, prompt_ids_checked=True)
