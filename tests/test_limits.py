"""Bounded requests with clean statuses, on a replica and on the router, over gRPC and HTTP.

The probes are the ones that used to get through (issue 19): n = 100000, max_tokens = 10^9,
10,000 stop strings, a body of garbage bytes, a 1 MB cache_salt, priority = -2^31. Each must
answer a clean status naming the field in under a second, and a normal request right after
must still succeed. Overload (a full waiting queue) must answer RESOURCE_EXHAUSTED / 429 with
a retry-after hint, on the replica and through the router.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from mini_cluster import MiniCluster, start_mini_cluster

from prefixmesh.limits import RequestLimits, check_context, check_request
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

MAX_MODEL_LEN = 512  # mini_cluster's --max-model-len
MAX_QUEUE = 2


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# -- unit: the checks themselves ---------------------------------------------------------


def test_check_request_names_the_field_and_the_bound():
    limits = RequestLimits(max_n=4, max_stop=2, max_stop_len=5, max_id_len=8, max_priority=10)
    cases = {
        "n": pb.GenerateRequest(sampling=pb.SamplingParams(n=5)),
        "stop must hold": pb.GenerateRequest(sampling=pb.SamplingParams(stop=["a", "b", "c"])),
        "stop[1]": pb.GenerateRequest(sampling=pb.SamplingParams(stop=["a", "abcdef"])),
        "request_id": pb.GenerateRequest(request_id="x" * 9),
        "cache_salt": pb.GenerateRequest(cache_salt="x" * 9),
        "priority": pb.GenerateRequest(priority=-11),
        "resume_text_chars": pb.GenerateRequest(resume_text_chars=-1),
        "token_ids.ids[2]": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, -3])),
        "resume_token_ids[0]": pb.GenerateRequest(resume_token_ids=[-1]),
    }
    for prefix, request in cases.items():
        with pytest.raises(ValueError, match=r"^" + prefix.replace("[", r"\[")):
            check_request(request, limits)
    # At the bounds: accepted.
    check_request(
        pb.GenerateRequest(
            request_id="x" * 8, cache_salt="y" * 8, priority=-10,
            sampling=pb.SamplingParams(n=4, stop=["abcde", "b"]),
        ),
        limits,
    )  # fmt: skip


def test_check_context_names_both_numbers_and_the_room():
    check_context(500, 12, 512)
    with pytest.raises(ValueError) as err:
        check_context(500, 13, 512)
    message = str(err.value)
    assert message.startswith("max_tokens=13") and "500" in message and "512" in message
    assert "ask for at most 12 tokens" in message
    with pytest.raises(ValueError) as err:
        check_context(600, 1, 512)
    assert "shorten the prompt" in str(err.value) and "ask for" not in str(err.value)


# -- the probes against real processes -----------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[MiniCluster]:
    c = start_mini_cluster(
        str(tiny_model_dir),
        replica_args=("--max-queue", str(MAX_QUEUE), "--max-num-seqs", "1",
                      "--max-message-bytes", str(2 * 2**20)),
        router_args=("--max-message-bytes", str(2 * 2**20), "--retry-after-s", "2"),
        namespace="lim",
    )  # fmt: skip
    yield c
    c.stop()


PROBES = [
    ("n", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=100000))),
    ("max_tokens=1000000000", pb.GenerateRequest(text="hi", sampling=greedy(10**9))),
    ("stop", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["s" * 50] * 10000))),
    ("stop[0]", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["s" * 5000]))),
    ("cache_salt", pb.GenerateRequest(text="hi", cache_salt="x" * 2**20)),
    ("request_id", pb.GenerateRequest(text="hi", request_id="r" * 10000)),
    ("priority", pb.GenerateRequest(text="hi", priority=-(2**31))),
    ("priority", pb.GenerateRequest(text="hi", priority=2**31 - 1)),
]  # fmt: skip

RAW = [
    ("could not be decoded", b"\xff\xfe garbage \x00\x01\x02" * 10),
    ("could not be decoded", b"\x0a\xff\xff\xff\xff\x0f"),  # a length past the end
]


def _ok(stub: pb_grpc.GeneratorStub) -> None:
    msgs = list(
        stub.Generate(pb.GenerateRequest(text="still here", sampling=greedy(2)), timeout=30)
    )
    assert msgs[-1].finish_reason == "length"


@pytest.mark.cluster
@pytest.mark.parametrize("target", ["replica", "router"])
def test_probes_get_invalid_argument_fast(cluster: MiniCluster, target: str):
    address = cluster.replica_grpc if target == "replica" else cluster.router_grpc
    with cluster.channel(address) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        raw = ch.unary_stream(
            "/prefixmesh.v1.Generator/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        calls = [(f, lambda r=r: list(stub.Generate(r, timeout=10))) for f, r in PROBES]
        calls += [(f, lambda b=b: list(raw(b, timeout=10))) for f, b in RAW]
        for field, call in calls:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call()
            took = time.monotonic() - started
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value)
            assert field in err.value.details(), (field, err.value.details())
            assert took < 1.0, f"{field}: {took:.2f}s"
            _ok(stub)
        # max_tokens vs the context names both numbers (and what fits).
        prompt = [7] * 500
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                  sampling=greedy(20)), timeout=10))  # fmt: skip
        details = err.value.details()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens=20" in details and "500" in details and str(MAX_MODEL_LEN) in details
        # A message over --max-message-bytes: RESOURCE_EXHAUSTED from gRPC itself.
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="x" * 3 * 2**20), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        _ok(stub)
    state = cluster.wait_idle()
    assert state.integrity_ok, state.integrity_error


def _post(url: str, body: bytes) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"{}")


@pytest.mark.cluster
@pytest.mark.parametrize("target", ["replica", "router"])
def test_http_probes_get_clean_4xx(cluster: MiniCluster, target: str):
    base = f"http://{cluster.replica_http if target == 'replica' else cluster.router_http}"
    url = f"{base}/v1/completions"
    probes = [
        (400, "n", {"prompt": "hi", "n": 100000}),
        (400, "max_tokens", {"prompt": "hi", "max_tokens": 10**9}),
        (400, "stop", {"prompt": "hi", "stop": ["s" * 50] * 1000}),
        (400, "cache_salt", {"prompt": "hi", "cache_salt": "x" * 100_000}),
        (400, "priority", {"prompt": "hi", "priority": -(2**31)}),
    ]
    for status, field, body in probes:
        started = time.monotonic()
        got, _headers, reply = _post(url, json.dumps(body).encode())
        assert time.monotonic() - started < 1.0, field
        assert got == status, (field, reply)
        assert reply["error"]["message"].startswith(field), reply
    got, _h, reply = _post(url, b"\xff\xfe not json")
    assert got == 400 and "JSON" in reply["error"]["message"]
    got, _h, reply = _post(url, json.dumps({"prompt": "x" * 3 * 2**20}).encode())
    assert got == 413 and "--max-message-bytes" in reply["error"]["message"]
    # max_tokens vs context: both numbers, in OpenAI's error format.
    got, _h, reply = _post(url, json.dumps({"prompt": [7] * 500, "max_tokens": 20}).encode())
    assert got == 400 and reply["error"]["param"] == "max_tokens"
    assert "500" in reply["error"]["message"] and str(MAX_MODEL_LEN) in reply["error"]["message"]
    # A chat without max_tokens ("until the context is full") still works on a small context.
    chat = {"messages": [{"role": "user", "content": "hello " * 100}], "temperature": 0}
    got, _h, reply = _post(f"{base}/v1/chat/completions", json.dumps(chat).encode())
    assert got == 200, reply
    usage = reply["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= MAX_MODEL_LEN
    got, _h, reply = _post(url, json.dumps({"prompt": "still here", "max_tokens": 2}).encode())
    assert got == 200 and reply["choices"][0]["finish_reason"] in ("length", "stop")


async def _flood(address: str, count: int) -> list[tuple[grpc.StatusCode, tuple]]:
    """``count`` concurrent long requests; (status, trailing metadata) of each."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GeneratorStub(ch)

        async def one(i: int) -> tuple[grpc.StatusCode, tuple]:
            call = stub.Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5 + i] * 40), sampling=greedy(40)),
                timeout=120,
            )
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code(), tuple(exc.trailing_metadata() or ())
            return grpc.StatusCode.OK, ()

        return await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.cluster
@pytest.mark.parametrize("target", ["replica", "router"])
def test_overload_is_resource_exhausted_with_retry_after(cluster: MiniCluster, target: str):
    address = cluster.replica_grpc if target == "replica" else cluster.router_grpc
    results = asyncio.run(_flood(address, 10))
    codes = [code for code, _ in results]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) >= 1
    busy = [dict(md) for code, md in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert busy, "10 concurrent requests against 1 running + 2 waiting slots: some must bounce"
    expected = "1" if target == "replica" else "2"  # each server's own --retry-after-s
    assert all(md.get("retry-after") == expected for md in busy), busy
    state = cluster.wait_idle()
    assert state.integrity_ok, state.integrity_error


@pytest.mark.cluster
def test_overload_over_http_is_429_with_retry_after(cluster: MiniCluster):
    async def go() -> list[tuple[int, dict]]:
        loop = asyncio.get_running_loop()
        body = json.dumps({"prompt": [9] * 40, "max_tokens": 40, "ignore_eos": True}).encode()
        url = f"http://{cluster.router_http}/v1/completions"
        jobs = [loop.run_in_executor(None, _post, url, body) for _ in range(10)]
        return [(status, headers) for status, headers, _ in await asyncio.gather(*jobs)]

    results = asyncio.run(go())
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    limited = [h for s, h in results if s == 429]
    assert limited and all(h.get("Retry-After") == "2" for h in limited), results
    cluster.wait_idle()
