"""Which client talks to a target: ``make_client(protocol, target, ...)``.

The factory lives apart from the interface (loadtest/client.py) so that the clients import the
interface and this module imports the clients, never the other way round. Each client is
imported only when asked for, so a gRPC run does not load aiohttp and an HTTP run not grpc.
"""

from __future__ import annotations

from typing import Any

from loadtest.client import GenerateClient

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
    tls_files: Any = None,
) -> GenerateClient:
    """A client for ``target``; ``channels`` is gRPC's pool, ``max_connections`` HTTP's (0: no
    cap), ``model`` the HTTP body's ``model`` (None: the server's first)."""
    if protocol == "grpc":
        from loadtest.grpc_client import GrpcClient

        return GrpcClient(target, channels=channels, api_key=api_key, tls_files=tls_files)
    if protocol == "http":
        from loadtest.http_client import HttpClient

        if protocol_of(target) != "http":  # a bare HOST:PORT: https where a CA is given
            scheme = "https" if getattr(tls_files, "ca", "") else "http"
            target = f"{scheme}://{target}"
        return HttpClient(
            target, api_key=api_key, model=model, max_connections=max_connections,
            tls_files=tls_files,
        )  # fmt: skip
    raise ValueError(f"protocol must be one of: {', '.join(PROTOCOLS)} (got {protocol!r})")
