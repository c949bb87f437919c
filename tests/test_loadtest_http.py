"""The load tester's OpenAI HTTP client: against a small in-process SSE server that speaks our
server's format (fast), and against a real router + replica over HTTP with the router's gRPC
Cluster service for per-replica stats (cluster tier)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from helpers import Proc, free_port, start_redis, stop_all, wait_until

from loadtest.cli import main as loadtest_main
from loadtest.clients import make_client, protocol_of
from loadtest.http_client import HttpClient
from loadtest.request import LoadRequest, RequestResult
from loadtest.runner import measure
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

KEY = "sk-loadtest"
BLOCK = 16
# max_tokens values that make the fake server fail in a given way
TOO_MANY, FAIL_MID_STREAM, HANG = 99, 98, 97


@dataclass
class FakeOpenAI:
    """``/v1/models`` and streaming ``/v1/completions`` in our server's SSE format, with an
    unlimited prefix cache per replica (cached = leading 16-token blocks seen before, the last
    prompt token never cached) and two replicas chosen by the first prompt token's parity.

    Like our detokenizer holding back a partial character, the first two tokens of every answer
    arrive in one event, so the client must take the token count from the usage."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    seen: dict[str, set[tuple[int, ...]]] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    def cached(self, replica: str, prompt: list[int]) -> int:
        seen = self.seen.setdefault(replica, set())
        cached, hit = 0, True
        for end in range(BLOCK, len(prompt) + 1, BLOCK):
            key = tuple(prompt[:end])
            if hit and key in seen and end < len(prompt):
                cached = end
            else:
                hit = False
            seen.add(key)
        return cached

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            err = {"message": "invalid or missing API key", "code": "UNAUTHENTICATED"}
            return web.json_response({"error": err}, status=401)
        body = await request.json()
        self.bodies.append(body)
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        if max_tokens == TOO_MANY:
            err = {
                "message": "queue full",
                "type": "rate_limit_error",
                "code": "RESOURCE_EXHAUSTED",
            }
            return web.json_response({"error": err}, status=429)
        if max_tokens == HANG:
            await asyncio.sleep(3)
        replica = f"r{prompt[0] % 2}"
        cached = self.cached(replica, prompt)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Prefixmesh-Replica": replica}
        )
        await resp.prepare(request)

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        head = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake-model"}
        events = [2] + [1] * (max_tokens - 2)  # tokens per event
        for i, n in enumerate(events):
            if max_tokens == FAIL_MID_STREAM and i == 1:
                err = {"message": "replica lost", "code": "UNAVAILABLE"}
                await send({"error": err})
                break
            last = i == len(events) - 1
            choice = {"index": 0, "text": "ab" * n, "logprobs": None,
                      "finish_reason": "length" if last else None}  # fmt: skip
            await send({**head, "choices": [choice]})
            await asyncio.sleep(0.001)
        else:
            usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                     "total_tokens": len(prompt) + max_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached,
                                               "fetched_tokens": cached // 2}}  # fmt: skip
            await send({**head, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeOpenAI]]:
    """The fake on its own event loop in a thread (the load tester runs its own loop)."""
    fake, loop = FakeOpenAI(), asyncio.new_event_loop()
    port = free_port()
    runner = web.AppRunner(fake.app(), handler_cancellation=True)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}", fake
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_target_selects_the_protocol() -> None:
    assert protocol_of("http://127.0.0.1:8000") == protocol_of("HTTPS://h/") == "http"
    assert protocol_of("127.0.0.1:50050") == "grpc"
    assert isinstance(make_client("http", "127.0.0.1:8000"), HttpClient)
    assert make_client("http", "127.0.0.1:8000").base_url == "http://127.0.0.1:8000"


def _measure(url: str, reqs: list[LoadRequest], key: str = KEY) -> list[RequestResult]:
    async def go() -> list[RequestResult]:
        client = HttpClient(url, api_key=key)
        try:
            results = []
            for req in reqs:
                r = RequestResult(index=req.index, prompt_tokens=len(req.token_ids))
                await measure(client, req, r, time.perf_counter(), timeout=0.5)
                results.append(r)
            return results
        finally:
            await client.close()

    return asyncio.run(go())


def test_http_client_timings_usage_and_errors(fake_server: tuple[str, FakeOpenAI]) -> None:
    url, fake = fake_server
    prompt = list(range(100, 140))  # 40 tokens: two full blocks
    ok, again, busy, lost, hang = _measure(url, [
        LoadRequest(0, prompt, 6, cache_salt="s1"), LoadRequest(1, prompt, 6),
        LoadRequest(2, prompt, TOO_MANY), LoadRequest(3, prompt, FAIL_MID_STREAM),
        LoadRequest(4, prompt, HANG),
    ])  # fmt: skip
    assert ok.status == "OK" and ok.finish_reason == "length"
    assert ok.output_tokens == 6  # 5 text events; the count comes from usage.completion_tokens
    assert ok.first_token_time is not None and ok.send_time < ok.first_token_time <= ok.end_time
    assert len(ok.itl) == 4  # gaps between the 5 text events (the usage event adds none)
    assert ok.replica_id == "r0" and ok.prompt_tokens == 40 and ok.cached_tokens == 0
    assert again.cached_tokens == 32 and again.replica_id == "r0"
    assert (busy.status, busy.error) == ("HTTP_429", "queue full")
    assert lost.status == "HTTP_STREAM_UNAVAILABLE" and lost.error == "replica lost"
    assert hang.status == "DEADLINE_EXCEEDED"
    body = fake.bodies[0]
    assert body["prompt"] == prompt and body["max_tokens"] == 6 and body["stream"] is True
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True} and body["cache_salt"] == "s1"
    assert "cache_salt" not in fake.bodies[1]

    [denied] = _measure(url, [LoadRequest(0, prompt, 4)], key="wrong")
    assert denied.status == "HTTP_401" and "API key" in denied.error
    [refused] = _measure(f"http://127.0.0.1:{free_port()}", [LoadRequest(0, prompt, 4)])
    assert refused.status == "UNAVAILABLE"


def _workload_args(out: Path) -> list[str]:
    return [
        "--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "4",
        "--system-prompt-len", "64", "--question-len", "8", "--output-len", "4",
        "--rate", "inf", "--out", str(out), "--no-progress", "--no-plots",
    ]  # fmt: skip


def test_cli_http_target_without_cluster(
    fake_server: tuple[str, FakeOpenAI], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, fake = fake_server
    monkeypatch.setenv("PREFIXMESH_API_KEY", KEY)
    assert loadtest_main(["--target", url, *_workload_args(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"]["sent"] == summary["requests"]["ok"] == 8
    assert summary["requests"]["wrong_output_length"] == 0
    assert summary["latency_ms"]["ttft"]["count"] == 8
    assert "cluster" not in summary  # no --cluster: per-replica numbers from the responses
    replicas = summary["per_replica"]
    assert set(replicas) <= {"r0", "r1"} and sum(r["requests"] for r in replicas.values()) == 8
    assert all(r["hit_rate"] is not None for r in replicas.values())
    assert summary["hit_rate"] > 0  # groups share a 64-token system prompt
    tokens = summary["tokens"]  # the fake says half its cached tokens came from a peer
    assert 0 < tokens["fetched"] <= tokens["cached"] // 2 + 8
    assert "api_key" not in summary["settings"]
    assert all(b["model"] == "fake-model" for b in fake.bodies)  # from GET /v1/models
    # --compare switches router policies through the Cluster service: HTTP needs --cluster.
    assert loadtest_main(["--target", url, "--compare", "round_robin",
                          *_workload_args(tmp_path / "c")]) == 2  # fmt: skip


# -- cluster tier: Redis, one tiny-model replica and a router, both serving HTTP -----------


def _lists_the_replica(router: str) -> bool:
    """The router's ListReplicas shows the replica with its block size."""
    with grpc.insecure_channel(router) as channel:
        state = pb_grpc.ClusterStub(channel).ListReplicas(
            pb.Empty(), timeout=2.0, metadata=(("authorization", f"Bearer {KEY}"),)
        )
    return [r.block_size > 0 for r in state.replicas] == [True]


@pytest.mark.cluster
def test_loadtest_over_http_against_router(tiny_model_dir: Path, tmp_path: Path) -> None:
    redis = start_redis()
    procs: list[Proc] = []
    rg, rh, qg, qh = (free_port() for _ in range(4))
    try:
        procs.append(Proc.cli("h0", *[
            "replica", "--port", str(rg), "--http-port", str(rh), "--redis", redis.url,
            "--model", str(tiny_model_dir), "--replica-id", "h0", "--threads", "1",
            "--num-blocks", "256",
        ]))  # fmt: skip
        procs.append(Proc.cli("router", *[
            "router", "--port", str(qg), "--http-port", str(qh), "--redis", redis.url,
            "--api-key", KEY,
        ]))  # fmt: skip
        procs[0].wait_serving(f"127.0.0.1:{rg}", 120.0)
        procs[1].wait_serving(f"127.0.0.1:{qg}", 60.0)
        wait_until(procs, lambda: _lists_the_replica(f"127.0.0.1:{qg}"), "router", 60.0)
        vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
        rc = loadtest_main([
            "--target", f"http://127.0.0.1:{qh}", "--cluster", f"127.0.0.1:{qg}",
            "--api-key", KEY, *_workload_args(tmp_path), "--rate", "20",
            "--vocab-size", str(vocab), "--min-token-id", "3", "--request-timeout", "60",
            "--max-duration", "60", "--drain-timeout", "60",
        ])  # fmt: skip
        assert rc == 0
    finally:
        stop_all(procs)
        redis.stop()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"]["sent"] == summary["requests"]["ok"] == 8
    assert summary["requests"]["wrong_output_length"] == 0
    assert summary["latency_ms"]["ttft"]["count"] == 8
    # Served by h0 (the X-Prefixmesh-Replica header), as the router's Cluster counters say.
    assert list(summary["per_replica"]) == ["h0"]
    replica = summary["cluster"]["replicas"]["h0"]
    assert replica["requests"] == 8 and replica["hit_rate"] is not None
    # The groups' 64-token system prompts are found cached after each group's first request.
    assert 0 < summary["cluster"]["hit_rate"] <= summary["best_hit_rate"] + 1e-9
    assert summary["per_replica"]["h0"]["cached_tokens"] == replica["cached_tokens"]
