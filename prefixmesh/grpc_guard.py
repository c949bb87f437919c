"""Undecodable gRPC request bodies answer INVALID_ARGUMENT, not ``UNKNOWN``. Torch-free.

gRPC decodes a request before any handler runs; when the bytes are not a valid message of the
method's type, grpc.aio answers ``UNKNOWN: Unexpected DecodeError``, a status clients treat as
a server fault (the router would even retry it elsewhere). ``DecodeGuardInterceptor`` wraps
each method's deserializer so that a decode failure becomes a marker value, and the handler
answers ``INVALID_ARGUMENT`` naming the message type. Used by replicas and routers.

``GuardedServer`` gives the same answers without an interceptor: it guards each handler once,
as the generated ``add_*Servicer_to_server`` functions register it. grpc.aio runs a chain of
coroutines for every call as soon as a server has any interceptor; a router without an API key
then has none on its request path.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, and anything a custom decoder raises
            return _Undecodable(exc)

    return decode


async def _refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"request body could not be decoded: {request.error}",
    )


def _guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that never raises (unary requests only)."""
    kwargs = {
        "request_deserializer": _safe(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.response_streaming:
        inner_stream = handler.unary_stream
        if inspect.iscoroutinefunction(inner_stream):  # writes its messages itself

            async def write(request: Any, context: grpc.aio.ServicerContext) -> None:
                if isinstance(request, _Undecodable):
                    await _refuse(request, context)
                await inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(write, **kwargs)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(request, context)
            async for message in inner_stream(request, context):
                yield message

        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    inner_unary = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        return await inner_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


def guard(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``handler`` with a deserializer that never raises, if it has a unary request to decode
    (else ``handler`` itself)."""
    if (
        handler is None
        or handler.request_streaming
        or handler.request_deserializer is None
        or not (handler.unary_unary or handler.unary_stream)
    ):
        return handler
    return _guarded(handler)


class _GuardCache:
    """Each handler guarded once. A server's handlers are the same objects on every call, so
    they are keyed by identity (the value keeps the handler alive, so its id is never reused);
    bounded in case some handler is built per call."""

    def __init__(self) -> None:
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler | None]] = {}

    def guarded(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler | None:
        known = self._wrapped.get(id(handler))
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = guard(handler)
        if len(self._wrapped) >= 1024:
            self._wrapped.clear()
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped


class _GuardedHandlers(grpc.GenericRpcHandler):
    """A generic handler's method handlers, each guarded the first time it is asked for."""

    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner
        self._cache = _GuardCache()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(details)
        return None if handler is None else self._cache.guarded(handler)


class GuardedServer:
    """A ``grpc.aio.Server`` as the generated ``add_*Servicer_to_server`` functions see it:
    every handler they register is guarded once, up front (the decode guard without an
    interceptor on every call). Pass it where the generated code takes a server; everything
    else goes to ``server`` itself."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.server.add_generic_rpc_handlers(tuple(_GuardedHandlers(h) for h in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.server.add_registered_method_handlers(
            service, {name: guard(h) for name, h in handlers.items()}
        )


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """Turns decode failures of unary-request methods into INVALID_ARGUMENT (put it last, so it
    wraps the handler the other interceptors chose)."""

    def __init__(self) -> None:
        self._cache = _GuardCache()  # each handler wrapped once, not on every request

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        return self._cache.guarded(handler)
