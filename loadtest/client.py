"""The client interface the runner drives: one streaming generation per call.

A client turns a ``LoadRequest`` into the server's wire format and yields ``Chunk``s as tokens
arrive; the runner does all the timing, so every client (gRPC, OpenAI HTTP) is
measured the same way. A new client implements ``stream`` and ``close`` and is added to
``make_client``: ``GrpcClient`` (loadtest/grpc_client.py) and ``HttpClient`` (OpenAI
``/v1/completions``, loadtest/http_client.py).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loadtest.request import LoadRequest


@dataclass(slots=True)
class Chunk:
    """Tokens that arrived in one message; the last chunk carries the finish reason and usage."""

    num_tokens: int
    finish_reason: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    replica_id: str = ""


class ClientError(Exception):
    """A failed request; ``status`` is a gRPC status name or an HTTP status such as ``HTTP_503``."""

    def __init__(self, status: str, message: str = "") -> None:
        super().__init__(f"{status}: {message}" if message else status)
        self.status = status
        self.message = message


class GenerateClient(abc.ABC):
    """Sends requests as token ids with ``ignore_eos`` and ``max_tokens`` = the output length.

    ``stream`` must not buffer: yield each chunk as soon as it is received. It raises
    ``ClientError`` on failure (``DEADLINE_EXCEEDED`` when ``timeout`` seconds pass).
    """

    @abc.abstractmethod
    def stream(self, request: LoadRequest, timeout: float | None) -> AsyncIterator[Chunk]: ...

    async def wait_ready(self, timeout: float) -> None:
        """Wait until the server accepts connections (no-op by default)."""
        return None

    @abc.abstractmethod
    async def close(self) -> None: ...


PROTOCOLS = ("grpc", "http")


def protocol_of(target: str) -> str:
    """``http`` for an ``http://`` or ``https://`` URL, else ``grpc`` (a host:port)."""
    return "http" if target.lower().startswith(("http://", "https://")) else "grpc"


def make_client(
    protocol: str,
    target: str,
    channels: int = 1,
    *,
    api_key: str = "",
    model: str | None = None,
    max_connections: int = 0,
) -> GenerateClient:
    """A client for ``target``; ``channels`` is gRPC's pool, ``max_connections`` HTTP's (0: no
    cap), ``model`` the HTTP body's ``model`` (None: the server's first)."""
    if protocol == "grpc":
        from loadtest.grpc_client import GrpcClient

        return GrpcClient(target, channels=channels, api_key=api_key)
    if protocol == "http":
        from loadtest.http_client import HttpClient

        if protocol_of(target) != "http":
            target = f"http://{target}"
        return HttpClient(target, api_key=api_key, model=model, max_connections=max_connections)
    raise ValueError(f"protocol must be one of: {', '.join(PROTOCOLS)} (got {protocol!r})")
