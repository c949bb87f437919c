"""The decode guard (prefixmesh/grpc_guard.py) in front of both handler styles a server uses:
an async generator (replicas) and a coroutine that writes its messages (the router)."""

from __future__ import annotations

import asyncio

import grpc

from prefixmesh.grpc_guard import DecodeGuardInterceptor
from proto import prefixmesh_pb2 as pb

METHODS = ("/t.T/Yields", "/t.T/Writes")


async def _yields(request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
    for i in range(2):
        yield pb.GenerateResponse(request_id=request.request_id, index=i)


async def _writes(request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
    for i in range(2):
        await context.write(pb.GenerateResponse(request_id=request.request_id, index=i))


def _handler(fn) -> grpc.RpcMethodHandler:  # type: ignore[no-untyped-def]
    return grpc.unary_stream_rpc_method_handler(
        fn,
        request_deserializer=pb.GenerateRequest.FromString,
        response_serializer=pb.GenerateResponse.SerializeToString,
    )


def test_both_handler_styles_answer_and_refuse_undecodable_bodies() -> None:
    async def scenario() -> None:
        guard = DecodeGuardInterceptor()
        server = grpc.aio.server(interceptors=[guard])
        handlers = {"Yields": _handler(_yields), "Writes": _handler(_writes)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for method in METHODS:
                    call = channel.unary_stream(
                        method,
                        request_serializer=lambda b: b,
                        response_deserializer=pb.GenerateResponse.FromString,
                    )
                    for _ in range(2):  # the second call reuses the wrapped handler
                        good = pb.GenerateRequest(request_id="r").SerializeToString()
                        got = [(m.request_id, m.index) async for m in call(good, timeout=5)]
                        assert got == [("r", 0), ("r", 1)], method
                        bad = call(b"\xff\xfe garbage \x00" * 5, timeout=5)
                        try:
                            [m async for m in bad]
                        except grpc.aio.AioRpcError as exc:
                            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, method
                            assert "could not be decoded" in (exc.details() or "")
                        else:
                            raise AssertionError(f"{method}: garbage was accepted")
            assert len(guard._cache._wrapped) == 2  # one wrapper per handler, however many calls
        finally:
            await server.stop(0)

    asyncio.run(scenario())
