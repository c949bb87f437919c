"""The optional API key of routers and replicas (``--api-key`` / ``PREFIXMESH_API_KEY``).

HTTP clients send ``Authorization: Bearer <key>``; gRPC clients send the same as metadata
(``authorization: Bearer <key>``); a router sends its ``--replica-api-key`` (else its
``--api-key``) to the replicas. Health checking and reflection stay open so load balancers
and ``grpcurl`` keep working; so do HTTP ``/health`` and ``/metrics``. Torch-free.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
API_KEY_ENV = "PREFIXMESH_API_KEY"


def bearer_ok(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``api_key`` (constant-time compare)."""
    if not api_key:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), api_key.encode())


def bearer_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that passes ``ApiKeyInterceptor`` (empty without a key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def client_api_key(flag: str | None) -> str:
    """A client command's key: its ``--api-key`` if given, else ``PREFIXMESH_API_KEY``.

    Read here rather than as the argparse default, so ``--help`` never prints the key.
    """
    return os.environ.get(API_KEY_ENV, "") if flag is None else flag


def missing_key_hint(code: grpc.StatusCode | None, api_key: str) -> str:
    """What to add to an UNAUTHENTICATED error when the client sent no key ("" otherwise)."""
    if code is grpc.StatusCode.UNAUTHENTICATED and not api_key:
        return f" (no API key sent: pass --api-key or set {API_KEY_ENV})"
    return ""


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection without ``authorization: Bearer <key>``."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if bearer_ok(metadata.get("authorization"), self.api_key):
            return handler
        return _denied(handler)
