"""The replica server as a real process: gRPC over loopback, a real Redis, the tiny model.

One replica serves most tests (module fixture, started with an API key that its stubs send);
the kill -9 and SIGTERM tests start their own, without a key.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import Proc, free_port, start_redis

from prefixmesh import redis_layout as layout
from prefixmesh.tokenizer import Tokenizer
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.cluster

NS = "pmtest"
NUM_BLOCKS = 48
MAX_QUEUE = 32
MAX_MODEL_LEN = 1024
KEY = "sk-replica-test"


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),  # fmt: skip
    grpc.ClientCallDetails,
):
    pass


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <key>`` to every unary and server-streaming call."""

    def __init__(self, key: str) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        keyed = _CallDetails(
            details.method, details.timeout, (*(details.metadata or ()), *self.metadata),
            details.credentials, details.wait_for_ready, details.compression,
        )  # fmt: skip
        return continuation(keyed, request)

    intercept_unary_stream = intercept_unary_unary


class ReplicaProcess:
    """``prefixmesh replica`` as a subprocess (tests/helpers.py ``Proc``), with stubs once its
    health says SERVING; with ``api_key`` it gets ``PREFIXMESH_API_KEY`` and its stubs send
    the key."""

    def __init__(
        self, model: str, redis_url: str, *extra: str, replica_id: str, api_key: str = ""
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.replica_id = replica_id
        self.child = Proc.cli(
            replica_id, "replica", "--model", model,
            "--port", str(self.port), "--redis", redis_url, "--namespace", NS,
            "--replica-id", replica_id, "--metrics-port", str(self.metrics_port),
            "--threads", "1", "--dtype", "float32", *extra,
            env={"PREFIXMESH_API_KEY": api_key},
        )  # fmt: skip
        self.proc = self.child.proc
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        # For the aio channels some tests open themselves.
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        if api_key:
            self.channel = grpc.intercept_channel(self.channel, _BearerKey(api_key))
        self.gen = pb_grpc.GeneratorStub(self.channel)
        self.admin = pb_grpc.ReplicaStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        try:  # health is not keyed, so the plain wait works with or without api_key
            self.child.wait_serving(f"127.0.0.1:{self.port}", timeout=180.0)
        except RuntimeError:
            self.stop()
            raise

    def logs(self) -> str:
        return self.child.logs(4000)

    def stop(self) -> None:
        self.channel.close()
        self.child.stop()


@pytest.fixture(scope="module")
def redis_handle():
    handle = start_redis()
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, redis_handle) -> Iterator[ReplicaProcess]:
    rep = ReplicaProcess(
        str(tiny_model_dir), redis_handle.url,
        "--num-blocks", str(NUM_BLOCKS), "--max-queue", str(MAX_QUEUE), "--max-num-seqs", "8",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "256",
        replica_id="rep-a", api_key=KEY,
    )  # fmt: skip
    yield rep
    rep.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(stub, request: pb.GenerateRequest, timeout: float = 60) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=timeout))


def wait_idle(rep: ReplicaProcess, timeout: float = 20.0) -> pb.CacheState:
    """The cache state once nothing runs: no request in flight, no block referenced."""
    deadline = time.monotonic() + timeout
    while True:
        state = rep.admin.GetCacheState(pb.Empty(), timeout=10)
        if state.inflight_requests == 0 and state.used_blocks == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(
                f"replica not idle: {state.inflight_requests} in flight, "
                f"{state.used_blocks} blocks used"
            )
        time.sleep(0.05)


def redis_matches_engine(rep: ReplicaProcess, client: redis.Redis, timeout: float = 5.0):
    """Redis' block set for the replica equals the engine's own (checked while idle)."""
    deadline = time.monotonic() + timeout
    while True:
        engine = set(wait_idle(rep).block_hashes)
        held = set(client.smembers(layout.blocks_key(rep.replica_id, NS)))
        if held == engine:
            return engine
        if time.monotonic() > deadline:
            raise AssertionError(
                f"Redis holds {len(held)} blocks, engine {len(engine)}: "
                f"{len(engine - held)} missing, {len(held - engine)} extra"
            )
        time.sleep(0.02)


def test_generate_streams_token_ids_text_and_chat(replica: ReplicaProcess, tok: Tokenizer):
    prompt = tok.encode("the cache prefix token router replica model block hash batch " * 4)
    assert len(prompt) > 2 * 16
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=greedy(6))
    first = run(replica.gen, req)
    assert len(first) == 6  # one message per engine step
    assert all(m.replica_id == "rep-a" for m in first)
    assert [len(m.token_ids) for m in first] == [1] * 6
    last = first[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 6)
    assert all(not m.finish_reason for m in first[:-1])

    again = run(replica.gen, req)
    usage = again[-1].usage
    assert 16 <= usage.cached_tokens < len(prompt) and usage.cached_tokens % 16 == 0
    assert [m.token_ids for m in again] == [m.token_ids for m in first]  # greedy, same cache

    text = run(
        replica.gen,
        pb.GenerateRequest(
            text="hello world, the prefix cache", sampling=greedy(5), request_id="mine"
        ),
    )
    assert {m.request_id for m in text} == {"mine"}
    assert text[-1].usage.prompt_tokens == len(tok.encode("hello world, the prefix cache"))
    assert sum(len(m.token_ids) for m in text) == text[-1].usage.completion_tokens == 5

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = run(
        replica.gen,
        pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
            sampling=pb.SamplingParams(max_tokens=8, temperature=0.7, seed=3),
        ),
    )
    assert chat[-1].finish_reason in ("stop", "length")
    assert chat[-1].usage.prompt_tokens == len(tok.encode_chat(messages))
    assert "".join(m.text for m in chat) == tok.decode([t for m in chat for t in m.token_ids])

    two = run(
        replica.gen,
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt[:20]),
            sampling=pb.SamplingParams(max_tokens=4, n=2, ignore_eos=True),
        ),
    )
    finals = {m.index: m for m in two if m.finish_reason}
    assert sorted(finals) == [0, 1]
    assert all(m.usage.completion_tokens == 4 for m in finals.values())


def test_resume_token_ids_continue_the_budget(replica: ReplicaProcess, tok: Tokenizer):
    prompt = tok.encode("a request that fails over mid stream to another replica")
    full = run(
        replica.gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=greedy(8))
    )
    ids = [t for m in full for t in m.token_ids]
    resumed = run(
        replica.gen,
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), sampling=greedy(8), resume_token_ids=ids[:3]
        ),
    )
    assert [t for m in resumed for t in m.token_ids] == ids[3:]
    usage = resumed[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 8)


def test_resume_text_chars_streams_the_text_the_client_missed(
    replica: ReplicaProcess, tok: Tokenizer
):
    prompt = tok.encode("a stop string that spans the point where the stream failed over")
    full = run(
        replica.gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=greedy(8))
    )
    ids = [t for m in full for t in m.token_ids]
    texts = [m.text for m in full]  # one token per message
    text = "".join(texts)
    assert "\ufffd" not in text  # random weights: no invalid UTF-8 run to render differently
    ends = list(itertools.accumulate(len(t) for t in texts))  # text length after each token
    # Resume after k tokens, with a stop string made of the 2 characters before the resume
    # point and the 2 after it (their first occurrence): one that spans the point.
    k = next(
        k
        for k in range(3, len(texts))
        if ends[k - 1] >= 4
        and len(texts[k]) >= 2
        and text.find(text[ends[k - 1] - 2 : ends[k - 1] + 2]) == ends[k - 1] - 2
    )
    head = text[: ends[k - 1]]
    stop = text[len(head) - 2 : len(head) + 2]

    def resume(chars: int | None, **sampling) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), sampling=greedy(8, **sampling),
            resume_token_ids=ids[:k],
        )  # fmt: skip
        if chars is not None:
            request.resume_text_chars = chars
        return run(replica.gen, request)

    # The text past resume_text_chars comes first; all of it received is the same as unset.
    for missing in (len(head), 3, 0):
        resumed = resume(len(head) - missing)
        assert [t for m in resumed for t in m.token_ids] == ids[k:]
        assert resumed[0].text.startswith(head[len(head) - missing :])
        assert "".join(m.text for m in resumed) == text[len(head) - missing :]
    unset = resume(None)
    assert [m.text for m in unset] == [m.text for m in resume(len(head))]

    # Undisturbed, the stop string's first 2 characters are held back after k tokens; resumed
    # from what the client had then, the stop string still stops the output at the same place.
    ref = run(
        replica.gen,
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=greedy(8, stop=[stop])),
    )
    ref_text = "".join(m.text for m in ref)
    assert ref_text == text[: len(head) - 2] and ref[-1].stop_reason == stop
    received = "".join(m.text for m in ref[:k])
    assert len(received) < len(head) and not ref[k - 1].finish_reason
    resumed = resume(len(received), stop=[stop])
    assert received + "".join(m.text for m in resumed) == ref_text
    assert [t for m in resumed for t in m.token_ids] == [t for m in ref[k:] for t in m.token_ids]
    assert (resumed[-1].finish_reason, resumed[-1].stop_reason) == ("stop", stop)
    assert resumed[-1].usage.completion_tokens == ref[-1].usage.completion_tokens

    # Unsent text that already holds a whole stop string is no continuation of a live sample.
    with pytest.raises(grpc.RpcError) as err:
        resume(0, stop=[head[1:3]])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume_text_chars" in err.value.details()


def test_redis_block_set_equals_engine_set_under_eviction(replica, redis_handle, tok):
    client = redis.Redis.from_url(redis_handle.url)
    lease = client.hgetall(layout.lease_key("rep-a", NS))
    stats = replica.admin.GetStats(pb.Empty())
    assert lease[b"address"] == f"127.0.0.1:{replica.port}".encode()
    assert lease[b"epoch"].decode() == stats.epoch != ""
    assert (lease[b"model"].decode(), lease[b"block_size"]) == (stats.model, b"16")
    assert lease[b"hash_scheme"] == stats.hash_scheme.encode()

    # A shared-prefix workload, concurrent, then Redis must hold exactly the engine's set.
    system = tok.encode("system prompt shared by a group of requests " * 3)
    reqs = [
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=system + tok.encode(f"question {i} " * 3)), sampling=greedy(4)
        )
        for i in range(8)
    ]
    _run_concurrently(replica, reqs)
    before = redis_matches_engine(replica, client)
    assert before

    # Eviction pressure: far more distinct prompt blocks than the pool holds.
    distinct = [
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[(7 * i + j) % 400 + 5 for j in range(160)]),
            sampling=greedy(2),
        )
        for i in range(8)
    ]
    _run_concurrently(replica, distinct)
    after = redis_matches_engine(replica, client)
    assert before - after, "no block was evicted: the pool is not under pressure"
    assert len(after) <= NUM_BLOCKS

    # Redis restarts empty: the replica notices and rewrites its whole set.
    redis_handle.restart()
    client = redis.Redis.from_url(redis_handle.url)
    assert redis_matches_engine(replica, client, timeout=15) == after
    assert client.hget(layout.lease_key("rep-a", NS), "epoch").decode() == stats.epoch
    # Serving never stopped.
    assert run(replica.gen, distinct[0])[-1].finish_reason == "length"
    redis_matches_engine(replica, client)
    client.close()


def _run_concurrently(rep: ReplicaProcess, reqs: list[pb.GenerateRequest]) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rep.port}") as ch:
            stub = pb_grpc.GeneratorStub(ch)

            async def one(r: pb.GenerateRequest) -> None:
                msgs = [m async for m in stub.Generate(r, timeout=60, metadata=rep.metadata)]
                assert msgs[-1].finish_reason == "length"

            await asyncio.gather(*(one(r) for r in reqs))

    asyncio.run(go())


def test_cancel_and_deadline_free_blocks(replica: ReplicaProcess):
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(5, 45))), sampling=greedy(700))
    aborted_before = replica.admin.GetStats(pb.Empty()).finished_by_reason.get("abort", 0)
    call = replica.gen.Generate(long, timeout=60)
    got = [next(call) for _ in range(3)]
    assert all(not m.finish_reason for m in got)
    assert replica.admin.GetCacheState(pb.Empty()).used_blocks > 0
    call.cancel()
    state = wait_idle(replica)
    assert state.integrity_ok, state.integrity_error

    with pytest.raises(grpc.RpcError) as err:
        run(replica.gen, long, timeout=0.15)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    state = wait_idle(replica)
    assert state.integrity_ok, state.integrity_error
    stats = replica.admin.GetStats(pb.Empty())
    assert stats.finished_by_reason.get("abort", 0) >= aborted_before + 2
    assert stats.load.free_blocks == stats.load.num_blocks == NUM_BLOCKS


BAD_REQUESTS = [
    ("text", pb.GenerateRequest(text="", sampling=greedy(4))),
    ("input", pb.GenerateRequest(sampling=greedy(4))),
    ("token_ids", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]))),
    ("max_tokens", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0))),
    ("temperature", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1))),
    ("top_p", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0))),
    ("top_p", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.5))),
    ("top_k", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=-2))),
    ("min_p", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(min_p=2))),
    ("n", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=0))),
    ("logprobs", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logprobs=50))),
    ("min_tokens", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(min_tokens=-1))),
    ("stop_token_ids", pb.GenerateRequest(text="hi",
                                          sampling=pb.SamplingParams(stop_token_ids=[-3]))),
    ("stop", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=[""]))),
    ("role", pb.GenerateRequest(chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role="wizard", content="hi")]))),
    ("chat.messages", pb.GenerateRequest(chat=pb.ChatMessages())),
    ("token_ids.ids[1]", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 10**6]))),
    ("max_model_len", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * (MAX_MODEL_LEN + 10)))),
    ("resume_token_ids", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2),
                                            resume_token_ids=[5, 6])),
    ("resume_token_ids", pb.GenerateRequest(text="hi", resume_token_ids=[-1])),
    ("resume_text_chars", pb.GenerateRequest(text="hi", resume_token_ids=[5, 6],
                                             resume_text_chars=-1)),
    ("resume_text_chars", pb.GenerateRequest(text="hi", resume_token_ids=[5, 6],
                                             resume_text_chars=10**6)),
    ("resume_text_chars", pb.GenerateRequest(text="hi", resume_text_chars=1)),
]  # fmt: skip


@pytest.mark.parametrize("field,request_", BAD_REQUESTS, ids=[f for f, _ in BAD_REQUESTS])
def test_bad_arguments_are_invalid_argument(replica: ReplicaProcess, field: str, request_):
    with pytest.raises(grpc.RpcError) as err:
        run(replica.gen, request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    # ... and the server keeps serving.
    ok = run(replica.gen, pb.GenerateRequest(text="still here", sampling=greedy(1)))
    assert ok[-1].finish_reason == "length"


def test_full_queue_answers_resource_exhausted(replica: ReplicaProcess):
    async def go() -> tuple[list[int], list[grpc.StatusCode]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}") as ch:
            stub = pb_grpc.GeneratorStub(ch)

            async def one(i: int) -> int | grpc.StatusCode:
                req = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[5 + i % 50] * 24), sampling=greedy(30)
                )
                try:
                    msgs = [
                        m async for m in stub.Generate(req, timeout=120, metadata=replica.metadata)
                    ]
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                assert msgs[-1].finish_reason == "length"
                return msgs[-1].usage.completion_tokens

            results = await asyncio.gather(*(one(i) for i in range(200)))
        done = [r for r in results if isinstance(r, int)]
        failed = [r for r in results if not isinstance(r, int)]
        return done, failed

    done, failed = asyncio.run(go())
    assert set(failed) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(failed) > 0 and len(done) >= MAX_QUEUE
    assert len(done) + len(failed) == 200
    assert all(n == 30 for n in done)  # every admitted request completed in full
    state = wait_idle(replica)
    assert state.integrity_ok, state.integrity_error


def test_reflection_health_and_metrics(replica: ReplicaProcess):
    stub = reflection_pb2_grpc.ServerReflectionStub(replica.channel)
    answers = stub.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="prefixmesh.v1.Generator"),
    ]))  # fmt: skip
    listed, described = list(answers)
    names = {s.name for s in listed.list_services_response.service}
    assert {"prefixmesh.v1.Generator", "prefixmesh.v1.Replica", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names  # fmt: skip
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]  # fmt: skip
    methods = {m.name for f in files for s in f.service if s.name == "Generator" for m in s.method}
    assert methods == {"Generate"}

    for service in ("", "prefixmesh.v1.Generator", "prefixmesh.v1.Replica"):
        status = replica.health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING

    info = replica.admin.GetModelInfo(pb.Empty())
    tok = Tokenizer.from_bytes(info.tokenizer_json, info.tokenizer_config_json)
    assert tok.encode("the prefix cache") == Tokenizer.from_dir(_model_dir(replica)).encode(
        "the prefix cache"
    )
    # The context is capped at what the KV pool holds (48 blocks of 16 < --max-model-len 1024).
    expected_len = min(MAX_MODEL_LEN, NUM_BLOCKS * 16)
    assert (info.block_size, info.max_model_len, info.replica_id) == (16, expected_len, "rep-a")

    run(replica.gen, pb.GenerateRequest(text="metrics please", sampling=greedy(3)))
    body = urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics").read()
    samples = _samples(body.decode())
    for name in ("prefixmesh_time_to_first_token_seconds_count",
                 "prefixmesh_inter_token_latency_seconds_count",
                 "prefixmesh_request_queue_time_seconds_count",
                 "prefixmesh_e2e_request_latency_seconds_count",
                 "prefixmesh_prefix_cache_queries_total"):  # fmt: skip
        assert samples[name] > 0, name
    for name in ("prefixmesh_prefix_cache_hits_total", "prefixmesh_kv_cache_usage",
                 "prefixmesh_num_requests_running", "prefixmesh_num_requests_waiting",
                 "prefixmesh_preemptions_total", "prefixmesh_prefix_cache_kept_blocks",
                 "prefixmesh_prefix_cache_kept_evictions_total"):  # fmt: skip
        assert name in samples, name
    assert samples["prefixmesh_prefix_cache_kept_blocks"] == 0  # nothing waits now
    assert samples['prefixmesh_requests_finished_total{finish_reason="length"}'] >= 1


def test_api_key_guards_every_call_but_health(replica: ReplicaProcess):
    request = pb.GenerateRequest(text="keyed", sampling=greedy(2))
    with grpc.insecure_channel(f"127.0.0.1:{replica.port}") as bare:  # no key unless given
        gen, admin = pb_grpc.GeneratorStub(bare), pb_grpc.ReplicaStub(bare)
        for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as denied:
                list(gen.Generate(request, timeout=30, metadata=metadata))
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert denied.value.details() == "invalid or missing API key"
            with pytest.raises(grpc.RpcError) as denied:
                admin.GetStats(pb.Empty(), timeout=10, metadata=metadata)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {KEY}"),)
        out = list(gen.Generate(request, timeout=60, metadata=good))
        assert out[-1].finish_reason == "length" and out[-1].usage.completion_tokens == 2
        health = health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def _model_dir(rep: ReplicaProcess) -> str:
    args = list(rep.proc.args)
    return args[args.index("--model") + 1]


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        # Drop the model/replica labels so tests can look samples up by name (+ reason).
        if "{" in name:
            base, labels = name.split("{", 1)
            kept = [kv for kv in labels.rstrip("}").split(",")
                    if not kv.startswith(("model=", "replica="))]  # fmt: skip
            name = base + ("{" + ",".join(kept) + "}" if kept else "")
        out[name] = float(value)
    return out


def test_kill9_lease_gone_within_3s(tiny_model_dir: Path, redis_handle):
    rep = ReplicaProcess(
        str(tiny_model_dir), redis_handle.url, "--num-blocks", "32", replica_id="rep-killed"
    )
    client = redis.Redis.from_url(redis_handle.url)
    try:
        run(
            rep.gen,
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(5, 60))), sampling=greedy(2)),
        )
        redis_matches_engine(rep, client)
        assert client.exists(layout.lease_key("rep-killed", NS))
        rep.proc.kill()
        rep.proc.wait(10)
        killed = time.monotonic()
        while client.exists(layout.lease_key("rep-killed", NS)):
            assert time.monotonic() - killed < 3.5, "the lease outlived the process"
            time.sleep(0.05)
        ttl = client.pttl(layout.blocks_key("rep-killed", NS))
        assert ttl == -2 or 0 < ttl <= layout.BLOCKS_TTL_MS  # gone, or going by itself
    finally:
        client.close()
        rep.stop()


def test_sigterm_drains_in_flight_and_deregisters(tiny_model_dir: Path, redis_handle):
    rep = ReplicaProcess(
        str(tiny_model_dir), redis_handle.url, "--grace-period", "60", replica_id="rep-term"
    )
    client = redis.Redis.from_url(redis_handle.url)
    try:
        short = rep.gen.Generate(pb.GenerateRequest(text="finishes in time", sampling=greedy(10)))
        endless = rep.gen.Generate(pb.GenerateRequest(text="never finishes", sampling=greedy(1900)))
        next(short), next(endless)
        rep.proc.send_signal(signal.SIGTERM)
        assert list(short)[-1].finish_reason == "length"  # in flight: allowed to finish
        # Draining: not serving, no new work, already out of Redis.
        status = rep.health.Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            run(rep.gen, pb.GenerateRequest(text="too late", sampling=greedy(2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 5
        while client.exists(layout.lease_key("rep-term", NS)):
            assert time.monotonic() < deadline, "still registered in Redis while draining"
            time.sleep(0.02)
        # A second signal cuts the grace period short: the long stream is aborted.
        rep.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as err:
            list(endless)
        assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert rep.proc.wait(20) == 0
        assert not client.exists(layout.lease_key("rep-term", NS),
                                 layout.blocks_key("rep-term", NS))  # fmt: skip
        assert not client.sismember(layout.replicas_key(NS), "rep-term")
    finally:
        client.close()
        rep.stop()


@pytest.mark.slow
def test_smollm2_chat_and_prefix_reuse(redis_handle):
    rep = ReplicaProcess("smollm2", redis_handle.url, "--num-blocks", "256", replica_id="rep-smol")
    try:
        req = pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[
                pb.ChatMessage(role="system", content="You are a concise assistant."),
                pb.ChatMessage(role="user", content="What is the capital of France?"),
            ]),
            sampling=pb.SamplingParams(max_tokens=12, temperature=0.0),
        )  # fmt: skip
        first = run(rep.gen, req, timeout=120)
        assert "Paris" in "".join(m.text for m in first)
        second = run(rep.gen, req, timeout=120)
        assert second[-1].usage.cached_tokens >= 16
        assert "".join(m.text for m in second) == "".join(m.text for m in first)
    finally:
        rep.stop()
