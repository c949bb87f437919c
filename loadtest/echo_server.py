"""A model-free ``Generator`` server that answers instantly, for measuring the load tester's own
overhead and for fast end-to-end tests of the load-testing pipeline.

It streams ``max_tokens`` token ids back at once (``--tokens-per-message`` per message, optional
``--token-delay-ms`` between messages) and reports usage with ``cached_tokens`` from an unlimited
simulated prefix cache (leading full blocks seen in earlier prompts, hashed with
``prefixmesh.hashing``, same salt). It also serves a minimal ``Cluster`` service describing
itself as one replica, so the cluster-delta and ``--compare`` code paths run without a router.

    python -m loadtest.echo_server --port 50099
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from prefixmesh.hashing import block_hashes
from prefixmesh.request_defaults import requested_max_tokens
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

_MODEL_ID = "echo"


class EchoState:
    """Counters and the simulated prefix cache shared by both services."""

    def __init__(self, replica_id: str, block_size: int) -> None:
        self.replica_id = replica_id
        self.block_size = block_size
        self.policy = "echo"
        self.cache: set[bytes] = set()
        self.requests = self.prompt_tokens = self.cached_tokens = 0

    def admit(self, token_ids: list[int], salt: str) -> int:
        """Record a prompt; return how many of its tokens the simulated cache held."""
        hashes = block_hashes(token_ids, self.block_size, _MODEL_ID, salt or None)
        usable = (len(token_ids) - 1) // self.block_size  # never the last prompt token
        hits = 0
        for h in hashes[:usable]:
            if h not in self.cache:
                break
            hits += 1
        self.cache.update(hashes)
        cached = hits * self.block_size
        self.requests += 1
        self.prompt_tokens += len(token_ids)
        self.cached_tokens += cached
        return cached


class EchoGenerator(pb_grpc.GeneratorServicer):
    def __init__(self, state: EchoState, tokens_per_message: int, token_delay_s: float) -> None:
        self.state = state
        self.tokens_per_message = max(1, tokens_per_message)
        self.token_delay_s = token_delay_s

    async def Generate(self, request: pb.GenerateRequest, context):  # noqa: N802 (gRPC name)
        ids = list(request.token_ids.ids)
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "echo server needs token_ids")
        max_tokens = requested_max_tokens(request.sampling)
        cached = self.state.admit(ids, request.cache_salt)
        rid = self.state.replica_id
        sent = 0
        while sent < max_tokens:
            n = min(self.tokens_per_message, max_tokens - sent)
            out = [ids[(sent + i) % len(ids)] for i in range(n)]
            sent += n
            msg = pb.GenerateResponse(request_id=request.request_id, token_ids=out, replica_id=rid)
            if sent == max_tokens:
                msg.finish_reason = "length"
                msg.usage.CopyFrom(
                    pb.Usage(prompt_tokens=len(ids), completion_tokens=sent, cached_tokens=cached)
                )
            yield msg
            if self.token_delay_s and sent < max_tokens:
                await asyncio.sleep(self.token_delay_s)


class EchoCluster(pb_grpc.ClusterServicer):
    def __init__(self, state: EchoState, address: str) -> None:
        self.state = state
        self.address = address

    def _state(self) -> pb.ClusterState:
        s = self.state
        info = pb.ReplicaInfo(
            replica_id=s.replica_id,
            address=self.address,
            model=_MODEL_ID,
            block_size=s.block_size,
            requests=s.requests,
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            hit_rate=s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        )
        routing = pb.RoutingStats(
            decisions={"echo": s.requests} if s.requests else {},
            requests=s.requests,
            prompt_tokens=s.prompt_tokens,
            actual_cached_tokens=s.cached_tokens,
        )
        return pb.ClusterState(policy=s.policy, replicas=[info], routing=routing)

    async def ListReplicas(self, request, context):  # noqa: N802
        return self._state()

    async def SetPolicy(self, request, context):  # noqa: N802
        self.state.policy = request.policy
        return self._state()

    async def ResetStats(self, request, context):  # noqa: N802
        self.state.requests = self.state.prompt_tokens = self.state.cached_tokens = 0
        return self._state()


# gRPC core cancels calls (status CANCELLED, before any handler runs) when too many wait for the
# Python server to accept them (``grpc.server.max_pending_requests``, grpc/grpc#34782); a starved
# CPU got there at 500 requests/s. The echo server is here to measure the client, so it lets the
# queue grow instead.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
]


async def start_echo_server(
    port: int = 0,
    *,
    replica_id: str = "echo-0",
    block_size: int = 16,
    tokens_per_message: int = 1,
    token_delay_s: float = 0.0,
) -> tuple[grpc.aio.Server, int]:
    """Start on 127.0.0.1 (``port`` 0: a free one); returns the server and its port."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    state = EchoState(replica_id, block_size)
    pb_grpc.add_GeneratorServicer_to_server(
        EchoGenerator(state, tokens_per_message, token_delay_s), server
    )
    pb_grpc.add_ClusterServicer_to_server(EchoCluster(state, f"127.0.0.1:{port}"), server)
    await server.start()
    return server, port


async def _serve(args: argparse.Namespace) -> None:
    server, port = await start_echo_server(
        args.port,
        replica_id=args.replica_id,
        block_size=args.block_size,
        tokens_per_message=args.tokens_per_message,
        token_delay_s=args.token_delay_ms / 1e3,
    )
    print(f"echo server on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.echo_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    p.add_argument("--replica-id", default="echo-0")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens-per-message", type=int, default=1)
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    from loadtest.cli import run_async

    try:
        run_async(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
