"""An instant, model-free replica for router tests and the router overhead benchmark.

It speaks the replica's gRPC API and Redis contract (lease, load, block set), generates a
deterministic token sequence (each token a hash of the three before it, so a resumed request
continues exactly where a dead one stopped) and reports cached tokens from its own block set.
Token ``t`` reads ``<t>``; stop strings are matched (and held back) as a real replica does, and
a resume streams the resumed text past ``resume_text_chars`` first. No torch: it runs inside
the router's test process.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis

from prefixmesh import redis_layout as layout
from prefixmesh.auth import ApiKeyInterceptor
from prefixmesh.hashing import HASH_SCHEME, block_hashes
from prefixmesh.request_defaults import requested_max_tokens, requested_n
from prefixmesh.stop_strings import StopStringMatcher, unsent_text
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

VOCAB = 1000


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

    redis_url: str
    replica_id: str = field(default_factory=lambda: "echo-" + secrets.token_hex(3))
    namespace: str = layout.DEFAULT_NAMESPACE
    model: str = "echo"
    block_size: int = 4
    step_delay_s: float = 0.0
    tokenizer_json: bytes = b""
    tokenizer_config_json: bytes = b""
    tokenizer: object | None = None  # prefixmesh.tokenizer.Tokenizer for text/chat requests
    received: list[pb.GenerateRequest] = field(default_factory=list)
    cached: set[bytes] = field(default_factory=set)
    running: int = 0
    port: int = 0
    reject_with: grpc.StatusCode | None = None  # answer every Generate with this error
    lose_final: bool = False  # stream every token, then fail instead of the final message
    fail_after: int = 0  # fail (UNAVAILABLE) after this many tokens of a request not resumed
    api_key: str = field(default="", repr=False)  # as a replica's --api-key

    async def start(self) -> None:
        self.epoch = secrets.token_hex(4)
        self.server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(self.api_key)] if self.api_key else []
        )
        pb_grpc.add_GeneratorServicer_to_server(self, self.server)
        pb_grpc.add_ReplicaServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.redis = aioredis.Redis.from_url(self.redis_url, socket_timeout=0.5)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        await self._refresh()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _refresh(self) -> None:
        ns, rid = self.namespace, self.replica_id
        lease = {
            "address": self.address, "http_address": "", "model": self.model,
            "block_size": self.block_size, "hash_scheme": HASH_SCHEME, "epoch": self.epoch,
            "running": self.running, "waiting": 0, "kv_usage": 0.0, "queued_tokens": 0,
            "num_blocks": 1000, "updated_at": time.time(), "cached_blocks": len(self.cached),
        }  # fmt: skip
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(layout.replicas_key(ns), rid)
            pipe.hset(layout.lease_key(rid, ns), mapping=lease)
            pipe.pexpire(layout.lease_key(rid, ns), layout.LEASE_TTL_MS)
            if self.cached:
                pipe.sadd(layout.blocks_key(rid, ns), *self.cached)
                pipe.pexpire(layout.blocks_key(rid, ns), layout.BLOCKS_TTL_MS)
            await pipe.execute()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(layout.LOAD_REFRESH_S)
            try:
                await self._refresh()
            except Exception:  # Redis down: keep serving, re-register when it is back
                pass

    async def kill(self) -> None:
        """Die abruptly: streams break, connections are refused, the lease lingers."""
        self._refresher.cancel()
        await self.server.stop(None)
        await self.redis.aclose()

    async def stop(self) -> None:
        """Leave cleanly (lease deleted)."""
        self._refresher.cancel()
        try:
            await self.redis.delete(layout.lease_key(self.replica_id, self.namespace))
        except Exception:
            pass
        await self.server.stop(None)
        await self.redis.aclose()

    # -- Generator ----------------------------------------------------------------------------

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if self.tokenizer is None:
            raise ValueError("echo replica without tokenizer: send token_ids")
        if kind == "text":
            return self.tokenizer.encode(request.text)  # type: ignore[attr-defined]
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return self.tokenizer.encode_chat(messages)  # type: ignore[attr-defined]

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.received.append(request)
        if self.reject_with is not None:
            await context.abort(self.reject_with, f"echo replica rejects ({self.reject_with.name})")
        try:
            prompt = self._prompt(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        resumed = list(request.resume_token_ids)
        context_ids = prompt + resumed
        hashes = block_hashes(context_ids, self.block_size, self.model, request.cache_salt or None)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.cached:
            hit += 1
        self.cached.update(hashes)
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
            for step in range(max_tokens):
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                token = next_token(context_ids + out)
                out.append(token)
                text, matched = stop.feed(token_text(token))
                last = matched is not None or step == max_tokens - 1
                if last and matched is None:
                    text += stop.flush()
                text, unsent = unsent + text, ""
                for index in range(n):  # greedy-like: every sample is the same sequence
                    msg = pb.GenerateResponse(
                        request_id=rid, index=index, token_ids=[token], text=text,
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
                        msg.usage.cached_tokens = min(hit * self.block_size, len(prompt) - 1)
                    yield msg
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


async def _serve(redis_url: str, count: int, block_size: int, namespace: str) -> None:
    replicas = [
        EchoReplica(redis_url, f"echo-{i}", namespace=namespace, block_size=block_size)
        for i in range(count)
    ]
    for replica in replicas:
        await replica.start()
    print(" ".join(r.address for r in replicas), flush=True)
    await asyncio.Event().wait()  # until killed


def main(argv: list[str] | None = None) -> int:
    """``python -m router.echo_replica --redis URL --count N``: echo replicas in one process."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m router.echo_replica")
    parser.add_argument("--redis", required=True, help="Redis URL to register in")
    parser.add_argument("--count", type=int, default=1, help="replicas to start")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--namespace", default=layout.DEFAULT_NAMESPACE, help="Redis key prefix")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # Windows: the default loop works, only slower
        asyncio.run(_serve(args.redis, args.count, args.block_size, args.namespace))
    else:
        uvloop.run(_serve(args.redis, args.count, args.block_size, args.namespace))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
