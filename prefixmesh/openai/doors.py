"""Open the OpenAI HTTP front door of a replica or a router server (``--http-port``).

The contract between a server and its door is ``FrontDoor`` (prefixmesh/openai/http.py): the
server fills it in from its own typed state (model ids, tokenizer, readiness, metrics
registry) and this module only starts it, so the HTTP layer never reaches into a server.
"""

from __future__ import annotations

from prefixmesh.openai.http import FrontDoor, OpenAIHttpServer


def loopback(host: str, grpc_port: int) -> str:
    """Address of the process's own gRPC server (wildcard binds are reachable on 127.0.0.1)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"{host}:{grpc_port}"


async def open_front_door(door: FrontDoor, host: str, http_port: int) -> OpenAIHttpServer:
    """Serve ``door`` on ``host:http_port`` (after the process's gRPC server started)."""
    http = OpenAIHttpServer(door, host, http_port)
    await http.start()
    return http
