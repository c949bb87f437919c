"""The one echo server: an instant, model-free replica for the router's and the load tester's
tests and benchmarks.

It speaks the replica's gRPC API and Redis contract (lease, load, block set), generates a
deterministic token sequence (each token a hash of the three before it, so a resumed request
continues exactly where a dead one stopped) and reports cached tokens from its own block set,
block by block and never the last prompt token, as a real replica does. Token ``t`` reads
``<t>``; stop strings are matched (and held back) as a real replica does, and a resume streams
the resumed text past ``resume_text_chars`` first. No torch: it runs inside the router's test
process.

Without Redis (``redis_url=""``) it stands alone as the load tester's target: with
``serve_cluster`` it also serves a minimal ``Cluster`` service describing itself as a
one-replica cluster, so the load tester's cluster-delta and ``--compare`` paths run without a
router. ``tokens_per_message`` batches tokens into fewer messages (the load tester's overhead
benchmark varies it).

    python -m loadtest.echo_replica --redis URL --count 3      # echo replicas behind a router
    python -m loadtest.echo_replica --port 50099                # a stand-alone load-test target
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import redis.asyncio as aioredis

from prefixmesh import event_loop, kv_events
from prefixmesh import redis_layout as layout
from prefixmesh.auth import ApiKeyInterceptor
from prefixmesh.hashing import HASH_SCHEME, block_hashes
from prefixmesh.prompt_ids import prompt_token_ids
from prefixmesh.request_defaults import requested_max_tokens, requested_n
from prefixmesh.stop_strings import StopStringMatcher, unsent_text
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from prefixmesh.tokenizer import Tokenizer

VOCAB = 1000

# gRPC core cancels calls (status CANCELLED, before any handler runs) when too many wait for the
# Python server to accept them (``grpc.server.max_pending_requests``, grpc/grpc#34782); a starved
# CPU got there at 500 requests/s. An echo replica is there to measure its clients, so it lets
# the queue grow instead.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
]


def next_token(context: list[int]) -> int:
    """The echo model: a fixed function of the last three tokens."""
    a, b, c = ([0, 0, 0] + context)[-3:]
    return (31 * a + 17 * b + 7 * c + 3) % VOCAB


def token_text(token: int) -> str:
    """The echo model's text of a token."""
    return f"<{token}>"


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What an undisturbed request generates."""
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(next_token(prompt + out))
    return out


@dataclass
class EchoReplica(pb_grpc.GeneratorServicer, pb_grpc.ReplicaServicer):
    """One fake replica on 127.0.0.1; ``kill()`` stops it like ``kill -9`` would (its lease
    stays in Redis until it expires)."""

    redis_url: str = ""  # "": no Redis (a stand-alone load-test target)
    replica_id: str = field(default_factory=lambda: "echo-" + secrets.token_hex(3))
    namespace: str = layout.DEFAULT_NAMESPACE
    model: str = "echo"
    block_size: int = 4
    step_delay_s: float = 0.0
    tokenizer_json: bytes = b""
    tokenizer_config_json: bytes = b""
    tokenizer: Tokenizer | None = None  # for text and chat requests
    received: list[pb.GenerateRequest] = field(default_factory=list)
    cached: set[bytes] = field(default_factory=set)
    running: int = 0
    port: int = 0  # 0: a free one (set by start)
    tokens_per_message: int = 1
    serve_cluster: bool = False  # also serve Cluster, as a one-replica cluster
    policy: str = "echo"  # what the Cluster service reports (SetPolicy sets it)
    requests: int = 0  # counters the Cluster service reports (ResetStats zeroes them)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reject_with: grpc.StatusCode | None = None  # answer every Generate with this error
    lose_final: bool = False  # stream every token, then fail instead of the final message
    fail_after: int = 0  # fail (UNAVAILABLE) after this many tokens of a request not resumed
    api_key: str = field(default="", repr=False)  # as a replica's --api-key

    async def start(self) -> None:
        self.epoch = secrets.token_hex(4)
        self._seq, self._needs_reset, self._published = 0, True, set()
        self.server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(self.api_key)] if self.api_key else [],
            options=SERVER_OPTIONS,
        )
        pb_grpc.add_GeneratorServicer_to_server(self, self.server)
        pb_grpc.add_ReplicaServicer_to_server(self, self.server)
        if self.serve_cluster:
            pb_grpc.add_ClusterServicer_to_server(EchoCluster(self), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        self.redis: aioredis.Redis | None = None
        self._refresher: asyncio.Task[None] | None = None
        if self.redis_url:
            self.redis = aioredis.Redis.from_url(self.redis_url, socket_timeout=0.5)
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
            await self._refresh()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _refresh(self) -> None:
        assert self.redis is not None
        ns, rid = self.namespace, self.replica_id
        lease = {
            "address": self.address, "http_address": "", "model": self.model,
            "block_size": self.block_size, "hash_scheme": HASH_SCHEME, "epoch": self.epoch,
            "running": self.running, "waiting": 0, "kv_usage": 0.0, "queued_tokens": 0,
            "num_blocks": 1000, "updated_at": time.time(), "cached_blocks": len(self.cached),
            "kv_seq": self._seq,
        }  # fmt: skip
        # The set only grows (blocks an echo replica forgets stay listed: a stale map); a new
        # epoch, or a set that vanished (Redis restarted), is rewritten whole, like a replica's.
        reset, fresh = self._needs_reset, self.cached - self._published
        blocks = layout.blocks_key(rid, ns)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(layout.replicas_key(ns), rid)
            pipe.hset(layout.lease_key(rid, ns), mapping=lease)
            pipe.pexpire(layout.lease_key(rid, ns), layout.LEASE_TTL_MS)
            if reset:
                pipe.delete(blocks)
                pipe.set(layout.blocks_epoch_key(rid, ns), self.epoch, px=layout.BLOCKS_TTL_MS)
            written = set(self.cached) if reset else fresh
            if written:
                pipe.sadd(blocks, *written)
            if reset or fresh:
                self._seq += 1
                kv_events.queue_event(
                    pipe, ns, rid, self.epoch, self._seq, reset=reset, added=fresh
                )
            pipe.pexpire(blocks, layout.BLOCKS_TTL_MS)
            pipe.pexpire(layout.blocks_epoch_key(rid, ns), layout.BLOCKS_TTL_MS)
            pipe.exists(layout.blocks_epoch_key(rid, ns))
            *_, epoch_there = await pipe.execute()
        self._published = written if reset else self._published | fresh
        self._needs_reset = not epoch_there

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(layout.LOAD_REFRESH_S)
            try:
                await self._refresh()
            except Exception:  # Redis down: keep serving, re-register when it is back
                self._needs_reset = True

    async def kill(self) -> None:
        """Die abruptly: streams break, connections are refused, the lease lingers."""
        if self._refresher is not None:
            self._refresher.cancel()
        await self.server.stop(None)
        if self.redis is not None:
            await self.redis.aclose()

    async def stop(self) -> None:
        """Leave cleanly (lease deleted)."""
        if self._refresher is not None:
            self._refresher.cancel()
        if self.redis is not None:
            try:
                await self.redis.delete(layout.lease_key(self.replica_id, self.namespace))
            except Exception:
                pass
        await self.server.stop(None)
        if self.redis is not None:
            await self.redis.aclose()

    def _admit(self, prompt: list[int], context_ids: list[int], salt: str) -> int:
        """Record a request's blocks; return its cached prompt tokens as a replica counts them:
        whole leading blocks it held, never the last token of the context (it needs logits)."""
        hashes = block_hashes(context_ids, self.block_size, self.model, salt)
        usable = (len(context_ids) - 1) // self.block_size
        hit = 0
        while hit < usable and hashes[hit] in self.cached:
            hit += 1
        self.cached.update(hashes)
        cached = min(hit * self.block_size, len(prompt))
        self.requests += 1
        self.prompt_tokens += len(prompt)
        self.cached_tokens += cached
        return cached

    # -- Generator ----------------------------------------------------------------------------

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.received.append(request)
        if self.reject_with is not None:
            await context.abort(self.reject_with, f"echo replica rejects ({self.reject_with.name})")
        try:
            prompt = prompt_token_ids(request, self.tokenizer)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        resumed = list(request.resume_token_ids)
        context_ids = prompt + resumed
        cached = self._admit(prompt, context_ids, request.cache_salt)
        sp = request.sampling
        max_tokens = requested_max_tokens(sp) - len(resumed)
        n = requested_n(sp)
        rid = request.request_id
        stop = StopStringMatcher(list(sp.stop), sp.include_stop_str_in_output)
        unsent = ""
        if request.HasField("resume_text_chars"):
            text = "".join(token_text(t) for t in resumed)
            try:
                unsent = unsent_text(
                    text, request.resume_text_chars, list(sp.stop),
                    sp.include_stop_str_in_output, matching=True,
                )  # fmt: skip
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            unsent, _ = stop.feed(unsent)  # held back like any text that may start a stop
        self.running += 1
        try:
            out: list[int] = []
            window = context_ids[-3:]  # the echo model reads the last three tokens
            ids, text = [], ""  # what the next message carries
            for step in range(max_tokens):
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                token = next_token(window)
                window = [*window[-2:], token]
                out.append(token)
                piece, matched = stop.feed(token_text(token))
                last = matched is not None or step == max_tokens - 1
                if last and matched is None:
                    piece += stop.flush()
                ids.append(token)
                text, unsent = text + unsent + piece, ""
                if not last and len(ids) < self.tokens_per_message:
                    continue
                for index in range(n):  # greedy-like: every sample is the same sequence
                    msg = pb.GenerateResponse(
                        request_id=rid, index=index, token_ids=ids, text=text,
                        replica_id=self.replica_id,
                    )  # fmt: skip
                    if last and self.lose_final:
                        yield msg
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "died before the end")
                    if last:
                        msg.finish_reason = "stop" if matched is not None else "length"
                        msg.stop_reason = matched or ""
                        msg.usage.prompt_tokens = len(prompt)
                        msg.usage.completion_tokens = len(out) + len(resumed)
                        msg.usage.cached_tokens = cached
                    yield msg
                ids, text = [], ""
                if step + 1 == self.fail_after and not resumed:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "died mid-stream")
                if last:
                    break
        finally:
            self.running -= 1

    # -- Replica ------------------------------------------------------------------------------

    async def GetLoad(self, request: pb.Empty, context) -> pb.ReplicaLoad:  # noqa: N802
        return pb.ReplicaLoad(replica_id=self.replica_id, running=self.running)

    async def GetModelInfo(self, request: pb.Empty, context) -> pb.ModelInfo:  # noqa: N802
        return pb.ModelInfo(
            model=self.model,
            block_size=self.block_size,
            hash_scheme=HASH_SCHEME,
            max_model_len=1 << 20,
            tokenizer_json=self.tokenizer_json,
            tokenizer_config_json=self.tokenizer_config_json,
            replica_id=self.replica_id,
        )


class EchoCluster(pb_grpc.ClusterServicer):
    """A stand-alone echo replica's ``Cluster`` service: itself as a one-replica cluster."""

    def __init__(self, replica: EchoReplica) -> None:
        self.replica = replica

    def _state(self) -> pb.ClusterState:
        r = self.replica
        info = pb.ReplicaInfo(
            replica_id=r.replica_id,
            address=r.address,
            model=r.model,
            block_size=r.block_size,
            requests=r.requests,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            hit_rate=r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0,
        )
        routing = pb.RoutingStats(
            decisions={"echo": r.requests} if r.requests else {},
            requests=r.requests,
            prompt_tokens=r.prompt_tokens,
            actual_cached_tokens=r.cached_tokens,
        )
        return pb.ClusterState(policy=r.policy, replicas=[info], routing=routing)

    async def ListReplicas(self, request: pb.Empty, context) -> pb.ClusterState:  # noqa: N802
        return self._state()

    async def SetPolicy(self, request: pb.SetPolicyRequest, context) -> pb.ClusterState:  # noqa: N802
        self.replica.policy = request.policy
        return self._state()

    async def ResetStats(self, request: pb.Empty, context) -> pb.ClusterState:  # noqa: N802
        r = self.replica
        r.requests = r.prompt_tokens = r.cached_tokens = 0
        return self._state()


async def _serve(args: argparse.Namespace) -> None:
    alone = not args.redis  # a load-test target: it describes itself as a cluster
    replicas = [
        EchoReplica(
            args.redis,
            args.replica_id or f"echo-{i}",
            namespace=args.namespace,
            block_size=args.block_size,
            step_delay_s=args.token_delay_ms / 1e3,
            port=args.port if args.count == 1 else 0,
            tokens_per_message=args.tokens_per_message,
            serve_cluster=alone,
        )  # fmt: skip
        for i in range(args.count)
    ]
    for replica in replicas:
        await replica.start()
    print(" ".join(r.address for r in replicas), flush=True)  # started (and registered)
    await asyncio.Event().wait()  # until killed


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest.echo_replica``: echo replicas in one process, until killed."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.echo_replica",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--redis", default="", help="Redis URL to register in (none: stand alone, with Cluster)"
    )
    parser.add_argument("--count", type=int, default=1, help="replicas to start")
    parser.add_argument("--port", type=int, default=0, help="with --count 1 (0: a free port)")
    parser.add_argument("--replica-id", default="", help="with --count 1 (default: echo-0)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--namespace", default=layout.DEFAULT_NAMESPACE, help="Redis key prefix")
    parser.add_argument("--tokens-per-message", type=int, default=1)
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="before each token")
    args = parser.parse_args(argv)
    if args.count != 1 and (args.port or args.replica_id):
        parser.error("--port and --replica-id need --count 1")
    event_loop.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
