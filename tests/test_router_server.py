"""The router end to end in one process: real Redis, real gRPC, echo replicas (no model).

Echo replicas (loadtest/echo_replica.py) speak the replica API and Redis contract and generate a
deterministic sequence, so routing, failover and resume can be checked exactly and fast. The
same scenarios against real replica processes are in test_router_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import free_port, start_redis

from loadtest.echo_replica import EchoReplica, expected_output, token_text
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig, parse_config
from router.routing import Router
from router.server import RouterServer

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Cluster:
    router: RouterServer
    replicas: list[EchoReplica]
    generator: pb_grpc.GeneratorStub
    cluster: pb_grpc.ClusterStub

    async def generate(
        self, ids: list[int], max_tokens: int = 4, **kw
    ) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=max_tokens), **kw
        )
        return [r async for r in self.generator.Generate(request, timeout=10)]

    def by_address(self) -> dict[str, EchoReplica]:
        return {r.replica_id: r for r in self.replicas}


@contextlib.asynccontextmanager
async def cluster(
    redis_url: str, n: int = 3, step_delay_s: float = 0.0, replica_key: str = "", **config
) -> AsyncIterator[Cluster]:
    replicas = [
        EchoReplica(redis_url, f"echo-{i}", step_delay_s=step_delay_s, api_key=replica_key)
        for i in range(n)
    ]
    for r in replicas:
        await r.start()
    settings = dict(port=0, redis=redis_url, discovery_interval_s=0.1, router_id="r1")
    settings.update(config)
    router = RouterServer(RouterConfig(**settings))
    port = await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    c = Cluster(router, replicas, pb_grpc.GeneratorStub(channel), pb_grpc.ClusterStub(channel))
    try:
        await _wait_for(
            lambda: len(router.router.view.live()) == n and router.router.view.model_ids
        )
        yield c
    finally:
        await channel.close()
        await router.stop(grace=0)
        for r in replicas:
            with contextlib.suppress(Exception):
                await r.stop()


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.02)


def tokens_of(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_router_server_imports_no_torch() -> None:
    code = (
        "import sys, router.server, loadtest.router_bench, loadtest.echo_replica, prefixmesh.openai.doors;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_config_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXMESH_REDIS", "redis://10.0.0.1:6379/2")
    monkeypatch.setenv("PREFIXMESH_BALANCE_EPSILON", "0.25")
    config = parse_config(["--policy", "round_robin", "--port", "0"])
    assert config.redis == "redis://10.0.0.1:6379/2"
    assert config.balance_epsilon == 0.25 and config.policy == "round_robin"
    with pytest.raises(SystemExit):
        parse_config(["--policy", "fastest"])
    saturation = parse_config(["--saturation-tokens", "4096", "--duplicate-weight", "0"])
    assert saturation.saturation_tokens == 4096 and saturation.duplicate_weight == 0.0
    policy = Router.make_policy(SimpleNamespace(config=saturation), "cache_aware")
    assert policy.saturation_tokens == 4096 and policy.duplicate_weight == 0.0
    with pytest.raises(SystemExit):
        parse_config(["--duplicate-weight", "-1"])


@pytest.mark.parametrize("map_source", ["mirror", "redis"])
def test_groups_stick_to_one_replica_and_the_cluster_service_reports_it(
    redis_server: str, map_source: str
) -> None:
    async def scenario() -> None:
        # 4 equal groups on 3 replicas: one replica holds two, i.e. half the requests. The
        # request bound (--balance-requests-epsilon) would spill that replica's second group to
        # keep max/mean requests near 1.2; this test is about groups sticking: bound off.
        settings = dict(balance_requests_epsilon=-1.0, map_source=map_source)
        async with cluster(redis_server, **settings) as c:
            assert (c.router.router.mirror is None) == (map_source == "redis")
            groups = [[1000 + 50 * g + i for i in range(32)] for g in range(4)]  # 8 blocks each
            # Interleaved and concurrent: request r of every group, then r + 1, ...
            for rnd in range(4):
                results = await asyncio.gather(
                    *(c.generate(prefix + [rnd, g]) for g, prefix in enumerate(groups))
                )
                for responses in results:
                    final = responses[-1]
                    assert final.finish_reason == "length"
                    if rnd > 0:
                        assert final.usage.cached_tokens == 32
            by_group = {}
            for replica in c.replicas:
                for req in replica.received:
                    g = (req.token_ids.ids[0] - 1000) // 50
                    by_group.setdefault(g, set()).add(replica.replica_id)
            assert all(len(ids) == 1 for ids in by_group.values()), by_group
            assert len({next(iter(ids)) for ids in by_group.values()}) >= 2  # spread by groups

            state = await c.cluster.ListReplicas(pb.Empty())
            assert state.policy == "cache_aware" and state.redis_connected
            assert len(state.replicas) == 3 and state.router_id == "r1"
            routing = state.routing
            assert routing.requests == 16
            assert routing.decisions["cold"] == 4 and routing.decisions["warm"] == 12
            assert routing.prompt_tokens == 16 * 34
            assert routing.actual_cached_tokens == 12 * 32
            assert routing.predicted_cached_tokens == 12 * 32
            assert routing.hit_rate == pytest.approx(12 * 32 / (16 * 34))
            per_replica = {r.replica_id: r for r in state.replicas}
            assert sum(r.requests for r in per_replica.values()) == 16
            for r in per_replica.values():
                if r.prompt_tokens:
                    assert r.hit_rate == pytest.approx(r.cached_tokens / r.prompt_tokens)

            assert len(c.router.router.recent) == 16
            state = await c.cluster.SetPolicy(pb.SetPolicyRequest(policy="round_robin"))
            assert state.policy == "round_robin"
            # The request bound's window held the old policy's decisions; the new one starts
            # its own (Router.set_policy).
            assert len(c.router.router.recent) == 0
            state = await c.cluster.ResetStats(pb.Empty())
            assert state.routing.requests == 0 and all(r.requests == 0 for r in state.replicas)
            for _ in range(3):
                await c.generate(groups[0] + [9])
            state = await c.cluster.ListReplicas(pb.Empty())
            assert [r.requests for r in state.replicas] == [1, 1, 1]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.cluster.SetPolicy(pb.SetPolicyRequest(policy="fastest"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(scenario())


def test_health_reflection_and_metrics(redis_server: str) -> None:
    metrics_port = free_port()

    async def scenario() -> None:
        async with cluster(redis_server, n=2, metrics_port=metrics_port) as c:
            for i in range(3):
                await c.generate(list(range(40)) + [i])
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{c.router.port}")
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "prefixmesh.v1.Generator", "prefixmesh.v1.Cluster"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for reply in reflect.ServerReflectionInfo(iter([request])):
                names = {s.name for s in reply.list_services_response.service}
                assert {"prefixmesh.v1.Generator", "prefixmesh.v1.Cluster"} <= names
            await channel.close()
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
            assert "router_overhead_seconds_count 3.0" in text
            assert 'router_requests_total{outcome="cold"} 1.0' in text
            assert 'router_requests_total{outcome="warm"} 2.0' in text
            assert "router_redis_up 1.0" in text
            assert "router_live_replicas 2.0" in text
            assert "router_time_to_first_token_seconds_count 3.0" in text
            # Cached blocks per replica come from the replicas' own leases.
            holder = max(c.replicas, key=lambda r: len(r.cached))
            await _wait_for(
                lambda: (
                    c.router.router.view.handles[holder.replica_id].lease.cached_blocks
                    == len(holder.cached)
                )
            )
            state = await c.cluster.ListReplicas(pb.Empty())
            info = {r.replica_id: r for r in state.replicas}[holder.replica_id]
            assert info.cached_blocks == len(holder.cached) > 0

    asyncio.run(scenario())


def test_mid_stream_death_resumes_elsewhere_with_identical_output(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=2, step_delay_s=0.02) as c:
            prompt = list(range(100, 120))
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=12)
            )
            tokens, finals, killed = [], [], None
            async for resp in c.generator.Generate(request, timeout=10):
                tokens += resp.token_ids
                if resp.finish_reason:
                    finals.append(resp)
                if len(tokens) == 4 and killed is None:
                    killed = c.by_address()[resp.replica_id]
                    await killed.kill()
            assert tokens == expected_output(prompt, 12)
            assert len(finals) == 1 and finals[0].usage.prompt_tokens == 20
            assert finals[0].usage.completion_tokens == 12
            survivor = next(r for r in c.replicas if r is not killed)
            resumed = survivor.received[-1]
            assert list(resumed.token_ids.ids) == prompt
            assert list(resumed.resume_token_ids) == tokens[: len(resumed.resume_token_ids)]
            assert len(resumed.resume_token_ids) >= 4
            assert finals[0].replica_id == survivor.replica_id
            state = await c.cluster.ListReplicas(pb.Empty())
            assert state.routing.failovers == 1 and state.routing.errors == 0
            # The dead replica is out of the routing set at once, although its lease lingers.
            assert [r.replica_id for r in state.replicas] == [survivor.replica_id]
            for i in range(4):
                final = (await c.generate([7, 7, i]))[-1]
                assert final.replica_id == survivor.replica_id

    asyncio.run(scenario())


def test_client_resume_tokens_count_as_completion_as_on_a_replica(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=2, step_delay_s=0.02) as c:
            prompt = list(range(400, 420))
            full = expected_output(prompt, 10)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                resume_token_ids=full[:3],
                sampling=pb.SamplingParams(max_tokens=10),
            )
            async with grpc.aio.insecure_channel(c.replicas[0].address) as channel:
                direct = pb_grpc.GeneratorStub(channel).Generate(request, timeout=10)
                reference = [r async for r in direct][-1].usage
            assert (reference.prompt_tokens, reference.completion_tokens) == (20, 10)
            routed = [r async for r in c.generator.Generate(request, timeout=10)]
            assert [t for r in routed for t in r.token_ids] == full[3:]
            assert routed[-1].usage.completion_tokens == reference.completion_tokens
            assert routed[-1].usage.prompt_tokens == reference.prompt_tokens
            # The same after a mid-stream death: the router's own resume adds to the client's.
            tokens, killed = [], None
            async for resp in c.generator.Generate(request, timeout=10):
                tokens += resp.token_ids
                if len(tokens) == 2 and killed is None:
                    killed = c.by_address()[resp.replica_id]
                    await killed.kill()
                final = resp
            assert killed is not None and tokens == full[3:]
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (20, 10)

    asyncio.run(scenario())


def test_parallel_samples_resume_one_by_one(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=2, step_delay_s=0.02) as c:
            prompt = list(range(300, 310))
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=6, n=3)
            )
            outputs: dict[int, list[int]] = {0: [], 1: [], 2: []}
            finals = {}
            killed = None
            async for resp in c.generator.Generate(request, timeout=10):
                outputs[resp.index] += resp.token_ids
                if resp.finish_reason:
                    finals[resp.index] = resp
                if len(outputs[0]) == 2 and killed is None:
                    killed = c.by_address()[resp.replica_id]
                    await killed.kill()
            assert outputs == {i: expected_output(prompt, 6) for i in range(3)}
            assert all(f.usage.completion_tokens == 6 for f in finals.values())
            survivor = next(r for r in c.replicas if r is not killed)
            resumes = [r for r in survivor.received if r.resume_token_ids]
            assert len(resumes) == 3 and all(r.sampling.n == 1 for r in resumes)

    asyncio.run(scenario())


def test_concurrent_streams_all_resume_after_a_kill(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=2, step_delay_s=0.02) as c:
            prompt = list(range(300, 310))
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=6)
            )
            # Same prefix: both land on one replica, which then dies under them.
            streams = [c.generator.Generate(request, timeout=10) for _ in range(2)]
            outputs: list[list[int]] = [[], []]
            killed = False

            async def consume(i: int) -> None:
                nonlocal killed
                async for resp in streams[i]:
                    outputs[i] += resp.token_ids
                    if len(outputs[i]) == 2 and not killed:
                        killed = True
                        await c.by_address()[resp.replica_id].kill()

            await asyncio.gather(consume(0), consume(1))
            assert outputs == [expected_output(prompt, 6)] * 2

    asyncio.run(scenario())


def test_a_lost_final_message_is_completed_by_the_router(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=2) as c:
            for replica in c.replicas:
                replica.lose_final = True
            prompt = [9, 9, 9, 9, 1]
            responses = await c.generate(prompt, max_tokens=3)
            assert tokens_of(responses) == expected_output(prompt, 3)
            final = responses[-1]
            assert final.finish_reason == "length"
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (5, 3)
            # Nothing was left to generate: no replica got a resume request.
            assert not any(r.resume_token_ids for rep in c.replicas for r in rep.received)

    asyncio.run(scenario())


def texts_of(responses: list[pb.GenerateResponse]) -> dict[int, str]:
    out: dict[int, str] = {}
    for r in responses:
        out[r.index] = out.get(r.index, "") + r.text
    return out


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("completed", [False, True], ids=["never-matched", "matched-after"])
def test_text_held_back_for_a_stop_string_survives_a_mid_stream_death(
    redis_server: str, completed: bool, n: int
) -> None:
    prompt = list(range(600, 612))
    t = [token_text(x) for x in expected_output(prompt, 8)]
    # Tokens 2 and 3 start the stop string, so a replica holds their text back; it dies right
    # after token 3. The stop string is then either never completed or completed by token 4,
    # which the resuming replica generates.
    stop = t[2] + t[3] + (t[4] if completed else "!")

    async def scenario() -> None:
        async with cluster(redis_server, n=2) as c:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(max_tokens=8, n=n, stop=[stop]),
            )
            undisturbed = [r async for r in c.generator.Generate(request, timeout=10)]
            for replica in c.replicas:
                replica.fail_after = 4
            disturbed = [r async for r in c.generator.Generate(request, timeout=10)]

            want = "".join(t[:2]) if completed else "".join(t)
            assert texts_of(undisturbed) == {i: want for i in range(n)}
            assert texts_of(disturbed) == texts_of(undisturbed)
            for i in range(n):
                mine = [r for r in disturbed if r.index == i]
                ref = [r for r in undisturbed if r.index == i]
                assert tokens_of(mine) == tokens_of(ref)
                assert (mine[-1].finish_reason, mine[-1].stop_reason) == (
                    ref[-1].finish_reason, ref[-1].stop_reason,
                )  # fmt: skip
                assert mine[-1].usage.completion_tokens == ref[-1].usage.completion_tokens
            # The death really came while text was held back: 4 tokens, 2 tokens' text.
            dead = disturbed[0].replica_id
            before = [r for r in disturbed if r.replica_id == dead]
            assert {len(tokens_of([r for r in before if r.index == i])) for i in range(n)} == {4}
            assert texts_of(before) == {i: t[0] + t[1] for i in range(n)}
            survivor = next(r for r in c.replicas if r.replica_id != dead)
            resumes = [r for r in survivor.received if r.resume_token_ids]
            assert len(resumes) == n
            assert all(r.resume_text_chars == len(t[0] + t[1]) for r in resumes)
            state = await c.cluster.ListReplicas(pb.Empty())
            assert state.routing.failovers == 1 and state.routing.errors == 0

    asyncio.run(scenario())


def test_unreachable_replica_is_retried_elsewhere_before_the_first_token(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=2) as c:
            victim = c.replicas[0]
            await victim.kill()  # lease still in Redis: the router only learns by failing
            for i in range(6):
                final = (await c.generate([5, 5, 5, i], max_tokens=2))[-1]
                assert final.replica_id == c.replicas[1].replica_id
            state = await c.cluster.ListReplicas(pb.Empty())
            assert state.routing.errors == 0
            assert state.routing.retries <= 1  # one failure marks it dead for everyone after

    asyncio.run(scenario())


def test_busy_replica_is_skipped_and_request_errors_pass_through(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=2) as c:
            busy, other = c.replicas
            busy.reject_with = grpc.StatusCode.RESOURCE_EXHAUSTED  # its queue is full
            await c.cluster.SetPolicy(pb.SetPolicyRequest(policy="round_robin"))
            for i in range(4):
                final = (await c.generate([3, 1, 4, i], max_tokens=1))[-1]
                assert final.replica_id == other.replica_id
            state = await c.cluster.ListReplicas(pb.Empty())
            assert state.routing.retries == 4 and state.routing.errors == 0  # each hit busy first
            assert len(state.replicas) == 2  # busy is not dead: it stays in the routing set
            # A request the replica rejects as invalid is not retried elsewhere.
            busy.reject_with = None
            other.reject_with = grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                for i in range(2):  # round robin: one of the two hits the rejecting replica
                    await c.generate([2, 7, i], max_tokens=1)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            state = await c.cluster.ListReplicas(pb.Empty())
            assert state.routing.errors == 1 and state.routing.retries == 4

    asyncio.run(scenario())


def test_keyed_replicas_get_the_routers_key_and_refuse_a_wrong_one(redis_server: str) -> None:
    async def scenario() -> None:
        # cluster() waits for the model info, so GetModelInfo carried the key too.
        async with cluster(redis_server, n=2, replica_key="sk-r", replica_api_key="sk-r") as c:
            assert (await c.generate([1, 2, 3, 4, 5], max_tokens=3))[-1].finish_reason
            received = sum(len(r.received) for r in c.replicas)
            client_md = (("authorization", "Bearer sk-r"),)
            # No key, a wrong one, and the router's own --api-key (the one-key-cluster case).
            for keys, works in (({}, False), ({"replica_api_key": "wrong"}, False),
                                ({"api_key": "sk-r"}, True)):  # fmt: skip
                other = RouterServer(
                    RouterConfig(port=0, redis=redis_server, discovery_interval_s=0.1, **keys)
                )
                port = await other.start()
                try:
                    await _wait_for(lambda o=other: len(o.router.view.live()) == 2)
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                        stub, md = pb_grpc.GeneratorStub(channel), client_md if works else None
                        request = pb.GenerateRequest(
                            token_ids=pb.TokenIds(ids=[9, 8, 7]),
                            sampling=pb.SamplingParams(max_tokens=2),
                        )
                        if works:
                            out = [r async for r in stub.Generate(request, metadata=md)]
                            assert out[-1].finish_reason == "length"
                            continue
                        for _ in range(3):
                            with pytest.raises(grpc.aio.AioRpcError) as err:
                                _ = [r async for r in stub.Generate(request, timeout=10)]
                            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                            assert "refused the router's API key" in err.value.details()
                            assert "--replica-api-key" in err.value.details()
                        state = await pb_grpc.ClusterStub(channel).ListReplicas(pb.Empty())
                    # Not a replica failure: no retry, no replica marked dead.
                    assert len(state.replicas) == 2 and len(other.router.view.live()) == 2
                    assert state.routing.retries == 0 and state.routing.errors == 3
                    assert not other.router.view.model_ids  # GetModelInfo was refused too
                finally:
                    await other.stop(grace=0)
            assert sum(len(r.received) for r in c.replicas) == received + 1  # only the last

    asyncio.run(scenario())


def test_new_replicas_are_picked_up_without_restart(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=1) as c:
            late = EchoReplica(redis_server, "echo-late")
            await late.start()
            c.replicas.append(late)
            # No request needed: the background lease refresh finds it.
            await _wait_for(lambda: len(c.router.router.view.live()) == 2, timeout=5.0)
            await c.cluster.SetPolicy(pb.SetPolicyRequest(policy="round_robin"))
            served = {(await c.generate([1, 2, i], max_tokens=1))[-1].replica_id for i in range(4)}
            assert served == {"echo-0", "echo-late"}

    asyncio.run(scenario())


def test_deadline_and_cancellation_pass_through_to_the_replica(redis_server: str) -> None:
    async def scenario() -> None:
        async with cluster(redis_server, n=1, step_delay_s=0.2) as c:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(max_tokens=50)
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in c.generator.Generate(request, timeout=0.5):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await _wait_for(lambda: c.replicas[0].running == 0, timeout=5.0)
            call = c.generator.Generate(request)
            async for _ in call:
                break  # the first token arrived: the replica is generating
            assert c.replicas[0].running == 1
            call.cancel()
            await _wait_for(lambda: c.replicas[0].running == 0, timeout=5.0)
            assert c.router.router.view.handles["echo-0"].inflight_requests == 0

    asyncio.run(scenario())


def test_redis_outage_keeps_serving_and_cache_aware_routing_resumes() -> None:
    redis_handle = start_redis()

    async def scenario() -> None:
        async with cluster(redis_handle.url, n=2) as c:
            await c.generate(list(range(16)))
            redis_handle.stop()
            for i in range(4):
                final = (await c.generate(list(range(16)) + [i]))[-1]
                assert final.finish_reason == "length"
            state = await c.cluster.ListReplicas(pb.Empty())
            assert not state.redis_connected and state.routing.decisions["fallback"] >= 1
            redis_handle.start()
            await _wait_for(lambda: c.router.router.redis_ok, timeout=3.0)
            await c.cluster.ResetStats(pb.Empty())
            await _wait_for(lambda: len(c.router.router.view.live()) == 2, timeout=3.0)
            prompt = list(range(500, 532))
            await c.generate(prompt + [0])
            await asyncio.sleep(0.3)  # the echo replicas republish their block sets
            final = (await c.generate(prompt + [1]))[-1]
            assert final.usage.cached_tokens == 32
            state = await c.cluster.ListReplicas(pb.Empty())
            assert state.redis_connected
            assert state.routing.decisions["cold"] == 1 and state.routing.decisions["warm"] == 1

    try:
        asyncio.run(scenario())
    finally:
        redis_handle.stop()


def test_request_sent_past_the_holder_names_it_as_fetch_hint(redis_server: str) -> None:
    async def scenario() -> None:
        # round_robin ignores caches: the second request goes past the replica holding it.
        async with cluster(redis_server, n=2, policy="round_robin") as c:
            prefix = [3000 + i for i in range(48)]  # 12 blocks of the echo replicas' 4 tokens
            await c.generate(prefix + [1])
            first = next(r for r in c.replicas if r.received)
            await asyncio.sleep(0.5)  # its KV events reach Redis
            await c.generate(prefix + [2])
            other = next(r for r in c.replicas if r is not first)
            hint = other.received[-1].fetch_hint
            assert hint.replica_id == first.replica_id
            assert hint.address == c.router.router.view.handles[first.replica_id].lease.address
            assert hint.num_blocks >= 12
            assert not first.received[-1].HasField("fetch_hint")  # it held nothing better
            # A client's own hint never reaches a replica (it would dial it with the key).
            bogus = pb.FetchHint(replica_id="x", address="203.0.113.1:1", num_blocks=99)
            await c.generate([7000 + i for i in range(16)], fetch_hint=bogus)
            assert all(r.received[-1].fetch_hint.address != bogus.address for r in c.replicas)

    asyncio.run(scenario())


def test_bookkeeping_waits_for_account_and_runs_once(redis_server: str) -> None:
    """route(defer_bookkeeping=True) commits what the next decision reads at once (load,
    predicted blocks, recent requests) and leaves metrics and miss attribution to account(),
    which the forwarder runs behind the upstream send; through the server nothing is lost."""

    async def scenario() -> None:
        async with cluster(redis_server, map_source="mirror") as c:
            r = c.router.router
            prefix = list(range(100, 132))  # 8 blocks of 4
            responses = await c.generate(prefix + [1])
            assert responses[-1].finish_reason == "length"
            state = await c.cluster.ListReplicas(pb.Empty())
            assert state.routing.requests == 1 and r.metrics.window.requests == 1
            assert state.routing.misses["cacheable"] == 8  # settled before the stream ended

            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prefix + [2]), sampling=pb.SamplingParams(max_tokens=1)
            )
            plan = await r.route(request, defer_bookkeeping=True)
            assert plan.handle.inflight_requests == 1 and len(r.recent) == 2
            assert r.metrics.window.requests == 1 and plan.misses is None
            r.account(plan)
            r.account(plan)  # a no-op the second time
            assert r.metrics.window.requests == 2 and plan.misses is not None
            assert plan.misses.seen_blocks == 8
            plan.release()
            assert plan.handle.inflight_requests == 0
            # The content count for cold placement: the prefix's 8 blocks, sent to one replica
            # twice; a prompt no replica holds goes to the replica sent nothing yet.
            warm_id = plan.handle.replica_id
            assert r.content.count(warm_id) == 8
            cold = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(500, 533))),
                sampling=pb.SamplingParams(max_tokens=1),
            )
            plan = await r.route(cold)
            assert plan.decision.outcome == "cold" and plan.handle.replica_id != warm_id
            assert r.content.count(plan.handle.replica_id) == 8
            plan.release()

    asyncio.run(scenario())


def test_router_bench_runs_a_baseline_checkout_in_the_same_rotation(tmp_path: Path) -> None:
    """``python -m loadtest.router_bench --baseline DIR`` (here: this checkout against itself) reports
    the baseline router's overhead and histograms beside the router under test."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.router_bench", "--map-source", "mirror", "--requests", "5",
         "--seconds", "0.2", "--concurrency", "2", "--baseline", str(ROOT), "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    import json

    result = json.loads(out.read_text())["map_sources"]["mirror"]
    for key in ("overhead_p50_ms", "baseline_overhead_p50_ms", "baseline_router_internal_p50_ms",
                "cpu_ms_per_request_baseline"):  # fmt: skip
        assert key in result and result[key] == result[key], key  # present, not NaN
    assert "| mirror, --baseline |" in proc.stdout
