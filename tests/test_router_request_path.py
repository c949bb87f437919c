"""The router's request path without per-call extras: the decode guard put on each handler as
it is registered (no server interceptor without an API key), and token ids packed once for the
hashes, which also stands for the bounds check's negative-id scan."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_router_server import cluster

from prefixmesh.grpc_guard import GuardedServer
from prefixmesh.hashing import block_hashes, token_bytes
from prefixmesh.limits import RequestLimits, check_request
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from router.prompt import BlockHashCache

GARBAGE = b"\xff\xfe garbage \x00" * 5


class _Echo(pb_grpc.GeneratorServicer):
    async def Generate(self, request, context):  # noqa: N802
        await context.write(pb.GenerateResponse(request_id=request.request_id))


def test_a_guarded_server_refuses_undecodable_bodies_without_interceptors() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()  # no interceptors at all
        pb_grpc.add_GeneratorServicer_to_server(_Echo(), GuardedServer(server))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                raw = channel.unary_stream(
                    "/prefixmesh.v1.Generator/Generate",
                    request_serializer=lambda b: b,
                    response_deserializer=pb.GenerateResponse.FromString,
                )
                for _ in range(2):
                    good = pb.GenerateRequest(request_id="r").SerializeToString()
                    assert [m.request_id async for m in raw(good, timeout=5)] == ["r"]
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        [m async for m in raw(GARBAGE, timeout=5)]
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                    assert "could not be decoded" in (err.value.details() or "")
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_router_refuses_undecodable_bodies_and_names_negative_ids(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=1) as c:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{c.router.port}")
            raw = channel.unary_stream(
                "/prefixmesh.v1.Generator/Generate",
                request_serializer=lambda b: b,
                response_deserializer=pb.GenerateResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in raw(GARBAGE, timeout=5)]
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            # A negative token id: the packing refuses it, the bounds check names it.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.generate([5, 6, -7, 8])
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "token_ids.ids[2] must be a token id >= 0 (got -7)" in err.value.details()
            assert len(await c.generate(list(range(40)), max_tokens=2)) >= 2
            await channel.close()

    asyncio.run(scenario())


def test_packing_refuses_negative_ids_and_hashes_as_the_list() -> None:
    with pytest.raises(OverflowError):
        token_bytes([1, -1])
    ids = list(range(3, 40))
    cache = BlockHashCache()
    assert cache.block_hashes(ids, 4, "m", None, token_bytes(ids)) == block_hashes(ids, 4, "m")
    assert cache.block_hashes(ids, 4, "m", "t") == block_hashes(ids, 4, "m", "t")
    # With the prompt known to be non-negative the scan is skipped; resume ids are still read.
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), resume_token_ids=[1, -2])
    with pytest.raises(ValueError, match=r"resume_token_ids\[1\]"):
        check_request(request, RequestLimits(), ids, prompt_ids_checked=True)


def _random_cluster(router, rng):
    """1-5 replicas of group ("m", 4) with random loads, leases, matches and predictions for a
    random prompt of up to 40 ids, installed in ``router``'s view."""
    from router.discovery import Lease, ReplicaHandle
    from router.index import ReplicaMatch

    ids = [rng.randrange(3) for _ in range(rng.randrange(0, 41))]
    hashes = block_hashes(ids, 4, "m")
    handles, matches = {}, []
    for i in range(rng.randrange(1, 6)):
        rid = f"r{i}"
        lease = Lease(address=f"a{i}", model="m", block_size=4,
                      queued_tokens=rng.choice([0, 16, 64, 500]),
                      fetch_cost=rng.choice([-1.0, 0.1, 0.9]),
                      num_blocks=rng.choice([0, 64]), free_blocks=rng.choice([0, 8, 64]))  # fmt: skip
        handle = ReplicaHandle(rid, lease, None, None, None)  # type: ignore[arg-type]
        handle.inflight_tokens = rng.choice([0, 8, 40, 300])
        handles[rid] = handle
        cached = rng.randrange(len(hashes) + 1)
        predicted = rng.randrange(cached, len(hashes) + 1)
        matches.append(ReplicaMatch(rid, cached, predicted, rng.choice([0, 50]), lease))
        router.book.predicted.pop(rid, None)
        if hashes and rng.random() < 0.3:  # this router's own predictions
            ahead = hashes[: rng.randrange(len(hashes) + 1)]
            router.book.predicted[rid] = dict.fromkeys(ahead, 1e18)
    router.view.handles, router.view.listed = handles, list(handles)
    return ids, hashes, handles, matches


def test_route_in_one_pass_decides_as_separate_passes_over_the_candidates() -> None:
    """``Router.route`` builds each candidate once and keeps the deepest match, its count and
    the runner-up as it goes: on random clusters (cache_aware with and without the request
    bound and fetch weights, and least_loaded) its decision, fetch hint and the miss
    attribution's blocks are what separate passes over the same candidates give."""
    import random

    from router.config import RouterConfig
    from router.index import ReplicaMatch
    from router.policy import RouteRequest, fetch_source
    from router.prompt import fallback_affinity
    from router.routing import Router

    group = ("m", 4)

    class Index:
        matches: list[ReplicaMatch] = []

        async def lookup(self, groups: object) -> list[ReplicaMatch]:
            return self.matches

    async def scenario() -> None:
        rng = random.Random(11)
        configs = [
            dict(policy="cache_aware"),
            dict(policy="cache_aware", balance_requests_epsilon=0.2, fetch_weight="off"),
            dict(policy="cache_aware", fetch_weight="2", tie_tokens=64),
            dict(policy="least_loaded"),
        ]
        for knobs in configs:
            router = Router(RouterConfig(redis="redis://127.0.0.1:1/0", **knobs))  # type: ignore[arg-type]
            router.index = Index()  # type: ignore[assignment]
            router.redis_ok = True
            router.view.model_ids[group] = "m"
            router.view.tokenizers[group] = None
            for _ in range(400):
                ids, hashes, handles, matches = _random_cluster(router, rng)
                blocks = len(hashes)
                Index.matches = matches
                # The separate passes, on the state route will see.
                by_id = {m.replica_id: m for m in matches}
                cands = [router._candidate(h, by_id, hashes, group) for h in handles.values()]
                best = max(c.matched_blocks for c in cands)
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids), request_id="q",
                    sampling=pb.SamplingParams(max_tokens=rng.choice([1, 16])),
                )  # fmt: skip
                if hashes:
                    affinity = hashes[best - 1] if best else hashes[-1]
                else:
                    affinity = fallback_affinity(ids, "q")
                plan = await router.route(request, defer_bookkeeping=True)
                route_req = RouteRequest(len(ids), blocks, 4, plan.decode_tokens, affinity)
                want = router.policy.choose(route_req, cands)
                chosen = next(c for c in cands if c.replica_id == want.replica_id)
                source = fetch_source(cands, chosen)
                work = plan.unaccounted
                assert work is not None and plan.decision == want
                assert work.promised_blocks == chosen.matched_blocks
                assert work.elsewhere_blocks == max(
                    (c.matched_blocks for c in cands if c is not chosen), default=0
                )
                assert (plan.fetch_hint is None) == (source is None)
                if source is not None and plan.fetch_hint is not None:
                    assert plan.fetch_hint.replica_id == source.replica_id
                    assert plan.fetch_hint.num_blocks == source.cached_blocks

    asyncio.run(scenario())


def test_predictions_end_when_announced_or_settled() -> None:
    """A predicted entry says "the replica is computing this block". It goes when the mirror
    sees the replica announce the block, and what is left is cut to the settle time once the
    request has its first token (and queued for the same cut in Redis), once."""
    import time

    from router.config import RouterConfig
    from router.discovery import Lease, ReplicaHandle
    from router.routing import RoutePlan, Router

    router = Router(RouterConfig(redis="redis://127.0.0.1:1/0", predicted_settle_ms=200))
    assert router.mirror is not None
    hashes = block_hashes(list(range(16)), 4, "m")
    far = time.monotonic() + 60
    router.book.predicted["r0"] = dict.fromkeys(hashes, far)
    router.mirror.on_added("r0", hashes[:1])  # the replica announced its first block
    assert list(router.book.predicted["r0"]) == hashes[1:]

    handle = ReplicaHandle("r0", Lease(address="a", model="m", block_size=4), None, None, None)  # type: ignore[arg-type]
    plan = RoutePlan(handle=handle, decision=None, prompt_ids=None, decode_tokens=1)  # type: ignore[arg-type]
    plan.predicted = hashes[1:3]  # this request's; hashes[3] is another request's
    router.redis_ok = True
    router.book.settle(plan)
    deadline = time.monotonic() + 0.2
    entries = router.book.predicted["r0"]
    assert max(entries[h] for h in hashes[1:3]) <= deadline and entries[hashes[3]] == far
    assert plan.predicted == [] and router.book.settled == {"r0": hashes[1:3]}
    router.book.settle(plan)  # once
    assert router.book.settled == {"r0": hashes[1:3]}
