"""The OpenAI HTTP front door on a router and on a replica, driven by the official ``openai``
client: Redis, one tiny-Llama replica process and one router process, both with one API key
(the router sends it on to the replica), plus `prefixmesh generate` / `top` with the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import Proc, free_port, start_redis, stop_all, wait_until

from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-key"
NS = "oai"


@dataclass
class Cluster:
    router_http: str
    router_grpc: str
    replica_http: str
    replica_grpc: str
    model: str
    redis_url: str


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _router_routes(router_http: str) -> bool:
    """Ready when the router lists the replica and has its tokenizer (models known)."""
    status, body = _get(f"http://{router_http}/v1/models", {"Authorization": f"Bearer {KEY}"})
    return status == 200 and len(json.loads(body)["data"]) == 1


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    redis = start_redis()
    procs: list[Proc] = []
    try:
        rg, rh, qg, qh = (free_port() for _ in range(4))
        procs.append(Proc.cli("replica", *[
            "replica", "--model", str(tiny_model_dir), "--port", str(rg), "--http-port", str(rh),
            "--redis", redis.url, "--namespace", NS, "--replica-id", "oai-0", "--threads", "1",
            "--dtype", "float32", "--max-model-len", "512", "--num-blocks", "128",
            "--api-key", KEY,
        ]))  # fmt: skip
        procs.append(Proc.cli("router", *[
            "router", "--port", str(qg), "--http-port", str(qh), "--redis", redis.url,
            "--namespace", NS, "--api-key", KEY,
        ]))  # fmt: skip
        wait_until(procs, lambda: _get(f"http://127.0.0.1:{rh}/health")[0] == 200, "replica")
        wait_until(procs, lambda: _router_routes(f"127.0.0.1:{qh}"), "router")
        yield Cluster(f"127.0.0.1:{qh}", f"127.0.0.1:{qg}", f"127.0.0.1:{rh}",
                      f"127.0.0.1:{rg}", str(tiny_model_dir), redis.url)  # fmt: skip
    finally:
        stop_all(procs)
        redis.stop()


def _client(address: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{address}/v1", api_key=key, max_retries=0, timeout=60)


def test_router_completion_n2_logprobs_and_usage(cluster: Cluster):
    client = _client(cluster.router_http)
    out = client.completions.create(
        model="whatever", prompt="the cache router", max_tokens=5, n=2, temperature=0.8,
        seed=1, logprobs=2, extra_body={"ignore_eos": True, "priority": 1, "unknown": 3},
    )  # fmt: skip
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 5
        assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.top_logprobs[0]
    usage = out.usage
    assert usage.completion_tokens == 10 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 10
    # The same long prompt twice: the second finds its full blocks in the prefix cache.
    long_prompt = "the cache router keeps prompt prefixes warm on the right replica " * 8
    first, second = (
        client.completions.create(model="m", prompt=long_prompt, max_tokens=1, temperature=0)
        for _ in range(2)
    )
    prompt_tokens = second.usage.prompt_tokens
    assert first.usage.prompt_tokens == prompt_tokens > 32
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < prompt_tokens


def test_router_batch_and_token_prompts(cluster: Cluster):
    client = _client(cluster.router_http)
    out = client.completions.create(
        model="m", prompt=["one prompt", "another prompt"], max_tokens=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 4
    ids = client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=2,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 2


def test_router_chat_and_streaming_chat(cluster: Cluster):
    client = _client(cluster.router_http)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something about prefix caches."}]  # fmt: skip
    whole = client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "cache_salt": "tenant-a"},
    )  # fmt: skip
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 6

    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=1,
        extra_body={"ignore_eos": True, "cache_salt": "tenant-a"},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same tokens
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    logprobs = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]  # fmt: skip
    assert len(logprobs) == 6 and all(len(t.top_logprobs) == 1 for t in logprobs)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 6
    # Same salt, same conversation: the second request found the first one's blocks.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_errors_in_openai_format(cluster: Cluster):
    with pytest.raises(openai.AuthenticationError) as auth:
        _client(cluster.router_http, key="wrong").completions.create(model="m", prompt="x")
    assert auth.value.status_code == 401 and auth.value.body["type"] == "authentication_error"
    client = _client(cluster.router_http)
    with pytest.raises(openai.BadRequestError) as bad:  # the engine's validation, via gRPC
        client.completions.create(model="m", prompt="x", temperature=-1)
    assert "temperature" in bad.value.body["message"]
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as shape:  # the HTTP layer's own checks
        client.chat.completions.create(model="m", messages=[])
    assert shape.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):  # a streamed error before any token: a status
        list(client.completions.create(model="m", prompt="x", max_tokens=0, stream=True))


def test_grpc_front_door_needs_the_key_but_health_stays_open(cluster: Cluster):
    channel = grpc.insecure_channel(cluster.router_grpc)
    try:
        stub = pb_grpc.GeneratorStub(channel)
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=1))
        with pytest.raises(grpc.RpcError) as denied:
            list(stub.Generate(request, timeout=30))
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = list(
            stub.Generate(request, timeout=30, metadata=(("authorization", f"Bearer {KEY}"),))
        )
        assert ok[-1].finish_reason
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        state = pb_grpc.ClusterStub(channel).ListReplicas(
            pb.Empty(), timeout=5, metadata=(("authorization", f"Bearer {KEY}"),)
        )
        assert state.replicas[0].http_address == cluster.replica_http  # the lease carries it
    finally:
        channel.close()


def test_replica_serves_openai_http_directly(cluster: Cluster):
    with pytest.raises(openai.AuthenticationError) as auth:  # keyed like the router
        _client(cluster.replica_http, key="wrong").models.list()
    assert auth.value.status_code == 401
    status, _ = _get(f"http://{cluster.replica_http}/v1/models")
    assert status == 401
    client = _client(cluster.replica_http)
    models = client.models.list()
    assert [m.id for m in models.data] == [json.loads(_get(
        f"http://{cluster.replica_http}/health")[1])["model"]]  # fmt: skip
    stream = client.completions.create(model=models.data[0].id, prompt="stream me", max_tokens=4,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    status, metrics = _get(f"http://{cluster.replica_http}/metrics")
    assert status == 200 and b"prefixmesh_prompt_tokens_total" in metrics
    status, metrics = _get(f"http://{cluster.router_http}/metrics")
    assert status == 200 and b"router_requests_total" in metrics


def test_multi_turn_chat_grows_cached_tokens(cluster: Cluster):
    client = _client(cluster.router_http)
    messages = [{"role": "system", "content": "You answer in a few words about caches."}]
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: why cache prefixes?"})
        out = client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
    assert cached[1] > 0 and cached[2] > cached[1], cached


def _aborted(replica_http: str) -> float:
    """Samples the replica finished with reason ``abort`` (from its /metrics)."""
    _, body = _get(f"http://{replica_http}/metrics")
    for line in body.decode().splitlines():
        if line.startswith("prefixmesh_requests_finished_total") and 'reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_disconnect_cancels_the_request(cluster: Cluster):
    before = _aborted(cluster.replica_http)
    client = _client(cluster.router_http)
    stream = client.completions.create(model="m", prompt="a long one", max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    stream.close()  # drop the connection mid-stream
    deadline = time.monotonic() + 20
    while _aborted(cluster.replica_http) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _aborted(cluster.replica_http) == before + 1  # aborted, not run to max_tokens
    with grpc.insecure_channel(cluster.replica_grpc) as channel:
        state = pb_grpc.ReplicaStub(channel).GetCacheState(
            pb.Empty(), timeout=10, metadata=(("authorization", f"Bearer {KEY}"),)
        )
    assert state.inflight_requests == 0 and state.used_blocks == 0  # KV blocks freed


def test_router_without_the_replicas_key_says_so(cluster: Cluster):
    """A second router on the same Redis but with no key: the keyed replica refuses it."""
    port = free_port()
    router = Proc.cli("router-nokey", *[
        "router", "--port", str(port), "--redis", cluster.redis_url, "--namespace", NS,
    ])  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            cluster_stub = pb_grpc.ClusterStub(channel)

            def listed() -> bool:
                return bool(cluster_stub.ListReplicas(pb.Empty(), timeout=5).replicas)

            wait_until([router], listed, "router")
            request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=1))
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=30))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "refused the router's API key" in refused.value.details()
            state = cluster_stub.ListReplicas(pb.Empty(), timeout=5)
        assert [r.replica_id for r in state.replicas] == ["oai-0"]  # not marked dead
        assert state.routing.retries == 0 and state.routing.errors == 2
        assert "refused the router's API key" in router.logs()
        assert KEY not in router.logs()
    finally:
        router.stop()


def _cli(*argv: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFIXMESH_API_KEY"}
    if key is not None:
        env["PREFIXMESH_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "prefixmesh.cli", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_generate_and_top_send_the_key(cluster: Cluster):
    ask = ["generate", "--router", cluster.router_grpc, "--max-tokens", "3", "--ignore-eos", "hi"]
    done = _cli(*ask, "--api-key", KEY)
    assert done.returncode == 0, done.stderr
    assert "3 tokens (length)" in done.stderr and "replica oai-0" in done.stderr
    assert _cli(*ask, key=KEY).returncode == 0  # from PREFIXMESH_API_KEY
    for denied in (_cli(*ask), _cli(*ask, "--api-key", "wrong", key=KEY)):
        assert denied.returncode == 1
        assert "prefixmesh generate: UNAUTHENTICATED: invalid or missing API key" in denied.stderr
        assert "Traceback" not in denied.stderr
    assert "no API key sent: pass --api-key or set PREFIXMESH_API_KEY" in _cli(*ask).stderr

    top = _cli("top", "--router", cluster.router_grpc, "--once", key=KEY)
    assert top.returncode == 0, top.stderr
    row = next(line for line in top.stdout.splitlines() if "oai-0" in line).split("│")
    assert row[5].strip().endswith("%"), top.stdout  # "engine hit": the replica's GetStats
    assert "refused" not in top.stdout
    denied = _cli("top", "--router", cluster.router_grpc, "--once")
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    assert "Traceback" not in denied.stderr
