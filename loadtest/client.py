"""The client interface the runner drives: one streaming generation per call.

A client turns a ``LoadRequest`` into the server's wire format and yields ``Chunk``s as tokens
arrive; the runner does all the timing, so every client (gRPC, OpenAI HTTP) is
measured the same way. A new client implements ``stream`` and ``close`` and is added to
``make_client`` (loadtest/clients.py): ``GrpcClient`` (loadtest/grpc_client.py) and
``HttpClient`` (OpenAI ``/v1/completions``, loadtest/http_client.py).
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
    fetched_tokens: int | None = None  # of cached_tokens, those a peer replica sent
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
