"""Mount the OpenAI HTTP front door on a replica or a router server (``--http-port``).

Each adapter reads what the HTTP layer needs (model ids, tokenizer, readiness, metrics
registry) from the server object it is given, so the servers' own code only starts and stops
it. Torch-free: the replica server object is only duck-typed here.
"""

from __future__ import annotations

from typing import Any

from prefixmesh.openai.http import FrontDoor, OpenAIHttpServer


def _loopback(host: str, grpc_port: int) -> str:
    """Address of the process's own gRPC server (wildcard binds are reachable on 127.0.0.1)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"{host}:{grpc_port}"


async def start_replica_http(
    server: Any, host: str, http_port: int, api_key: str = ""
) -> OpenAIHttpServer:
    """The front door of one ``replica.server.ReplicaServer`` (after its gRPC server started)."""
    engine = server.engine

    def ready() -> tuple[bool, dict[str, Any]]:
        ok = server.loop is not None and not server.draining
        return ok, {"replica_id": server.replica_id, "model": engine.model_id}

    door = FrontDoor(
        grpc_target=_loopback(host, server.port),
        models=lambda: [engine.model_id],
        tokenizer=lambda: engine.tokenizer,
        ready=ready,
        registry=server.metrics.registry,
        api_key=api_key,
    )
    http = OpenAIHttpServer(door, host, http_port)
    await http.start()
    return http


async def start_router_http(
    server: Any, host: str, http_port: int, api_key: str = ""
) -> OpenAIHttpServer:
    """The front door of one ``router.server.RouterServer`` (after its gRPC server started)."""
    view = server.router.view

    def models() -> list[str]:
        return sorted(set(view.model_ids.values()))

    def tokenizer() -> Any | None:
        return next((t for t in view.tokenizers.values() if t is not None), None)

    def ready() -> tuple[bool, dict[str, Any]]:
        live = len(view.live())
        return live > 0, {"replicas": live, "router_id": server.router.router_id}

    door = FrontDoor(
        grpc_target=_loopback(host, server.port),
        models=models,
        tokenizer=tokenizer,
        ready=ready,
        registry=server.metrics.registry,
        api_key=api_key,
    )
    http = OpenAIHttpServer(door, host, http_port)
    await http.start()
    return http
