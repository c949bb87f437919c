"""Fuzzing every field of ``GenerateRequest`` and of the OpenAI bodies against a replica and the
router (real processes, the tiny model).

Whatever a client sends, the answer is OK or a clean client-side status (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED; HTTP 4xx), never UNKNOWN / INTERNAL / 5xx; a successful stream is well
formed (every sample finishes once); the servers keep serving; and once idle the replica's block
pool passes its integrity check with no block still referenced and no request left in flight.

Bounded in CI (``PM_FUZZ_EXAMPLES`` examples per target and protocol, default 50); the longer
run is the same test with a larger budget:

    PM_FUZZ_EXAMPLES=1000 python -m pytest -q -p no:cacheprovider tests/test_fuzz.py
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mini_cluster import MiniCluster, start_mini_cluster

from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.cluster

EXAMPLES = int(os.environ.get("PM_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,  # every run explores afresh; a failure prints its example
)
CLIENT_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
SMALL = st.integers(-3, 12)


def _small_or(wide: st.SearchStrategy[int]) -> st.SearchStrategy[int]:
    """Mostly values near the edges of validity, sometimes anything in range."""
    return st.one_of(SMALL, SMALL, wide)


def _opt(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


def _ids(max_size: int) -> st.SearchStrategy[list[int]]:
    """Token id lists, often longer than a KV block (16), where the router starts hashing."""
    return st.one_of(
        st.lists(_small_or(INT32), max_size=8),
        st.lists(_small_or(INT32), min_size=16, max_size=max_size),
    )


TEXT = st.text(max_size=60)
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), TEXT)


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    optional = {
        "max_tokens": _small_or(INT32),
        "temperature": st.one_of(st.sampled_from([0.0, 0.7, 1.0]), FLOAT32),
        "top_p": st.one_of(st.sampled_from([1.0, 0.5]), FLOAT32),
        "top_k": _small_or(INT32),
        "min_p": st.one_of(st.sampled_from([0.0, 0.1]), FLOAT32),
        "seed": st.one_of(SMALL, INT64),
        "n": _small_or(INT32),
        "logprobs": _small_or(INT32),
        "min_tokens": _small_or(INT32),
        "skip_special_tokens": st.booleans(),
    }
    for name, strategy in optional.items():
        value = draw(_opt(strategy))
        if value is not None:
            setattr(sp, name, value)
    sp.stop.extend(draw(st.lists(st.text(max_size=8), max_size=4)))
    sp.stop_token_ids.extend(draw(st.lists(_small_or(INT32), max_size=4)))
    sp.ignore_eos = draw(st.booleans())
    sp.include_stop_str_in_output = draw(st.booleans())
    return sp


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), TEXT, st.text(min_size=250, max_size=300))),
        priority=draw(_small_or(INT32)),
        cache_salt=draw(st.one_of(st.just(""), TEXT, st.text(min_size=250, max_size=300))),
    )
    kind = draw(st.sampled_from(["text", "token_ids", "chat", "none"]))
    if kind == "text":
        request.text = draw(st.one_of(st.text(max_size=200), st.text(min_size=60, max_size=300)))
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(_ids(40)))
        request.token_ids.SetInParent()
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(ROLES, TEXT), max_size=4)):
            request.chat.messages.append(pb.ChatMessage(role=role, content=content))
        request.chat.SetInParent()
        flag = draw(_opt(st.booleans()))
        if flag is not None:
            request.chat.add_generation_prompt = flag
    request.sampling.CopyFrom(draw(sampling_params()))
    request.resume_token_ids.extend(draw(_ids(24)))
    chars = draw(_opt(_small_or(INT32)))
    if chars is not None:
        request.resume_text_chars = chars
    return request


# -- the servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[MiniCluster]:
    c = start_mini_cluster(str(tiny_model_dir), namespace="fuzz")
    yield c
    c.stop()


def _address(cluster: MiniCluster, target: str, http: bool = False) -> str:
    if http:
        return cluster.replica_http if target == "replica" else cluster.router_http
    return cluster.replica_grpc if target == "replica" else cluster.router_grpc


def _check_stream(request: pb.GenerateRequest, msgs: list[pb.GenerateResponse]) -> None:
    n = request.sampling.n if request.sampling.HasField("n") else 1
    finished = [m.index for m in msgs if m.finish_reason]
    assert sorted(finished) == list(range(n)), (finished, n)


def _healthy_afterwards(cluster: MiniCluster) -> None:
    """The servers still serve, and nothing leaked: no request, no block held, pool intact."""
    cluster.alive()
    for address in (cluster.replica_grpc, cluster.router_grpc):
        with cluster.channel(address) as ch:
            msgs = list(pb_grpc.GeneratorStub(ch).Generate(
                pb.GenerateRequest(text="still here", sampling=pb.SamplingParams(
                    max_tokens=2, temperature=0, ignore_eos=True)), timeout=30))  # fmt: skip
        assert msgs[-1].finish_reason == "length"
    state = cluster.wait_idle()
    assert state.integrity_ok, state.integrity_error
    assert state.free_blocks == state.num_blocks - state.used_blocks


@pytest.mark.parametrize("target", ["replica", "router"])
def test_fuzz_grpc_generate(cluster: MiniCluster, target: str):
    with cluster.channel(_address(cluster, target)) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        raw = ch.unary_stream(
            "/prefixmesh.v1.Generator/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )

        @FUZZ
        @given(request=generate_requests())
        def structured(request: pb.GenerateRequest) -> None:
            try:
                msgs = list(stub.Generate(request, timeout=60))
            except grpc.RpcError as exc:
                assert exc.code() in CLIENT_CODES, (exc.code(), exc.details(), request)
                assert exc.details(), request  # a message saying what to fix
                return
            _check_stream(request, msgs)

        @FUZZ
        @given(body=st.binary(max_size=300))
        def raw_bytes(body: bytes) -> None:
            try:
                list(raw(body, timeout=60))
            except grpc.RpcError as exc:
                assert exc.code() in CLIENT_CODES, (exc.code(), exc.details(), body)

        structured()
        raw_bytes()
    _healthy_afterwards(cluster)


# -- OpenAI bodies ---------------------------------------------------------------------------

JSON_JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)


def _field(typed: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(typed, typed, JSON_JUNK)


NUM = st.one_of(st.integers(-3, 12), st.floats(allow_nan=False), st.integers(-(2**40), 2**40))
COMMON = {
    "model": _field(st.just("m")),
    "max_tokens": _field(NUM),
    "max_completion_tokens": _field(NUM),
    "temperature": _field(NUM),
    "top_p": _field(NUM),
    "top_k": _field(NUM),
    "min_p": _field(NUM),
    "n": _field(st.integers(-2, 20)),
    "seed": _field(NUM),
    "stop": _field(st.one_of(TEXT, st.lists(TEXT, max_size=4))),
    "stop_token_ids": _field(st.lists(NUM, max_size=4)),
    "ignore_eos": _field(st.booleans()),
    "min_tokens": _field(NUM),
    "skip_special_tokens": _field(st.booleans()),
    "include_stop_str_in_output": _field(st.booleans()),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "priority": _field(NUM),
    "cache_salt": _field(TEXT),
    "frequency_penalty": _field(NUM),
    "presence_penalty": _field(NUM),
    "repetition_penalty": _field(NUM),
    "logit_bias": _field(st.dictionaries(TEXT, NUM, max_size=2)),
    "best_of": _field(st.integers(-2, 5)),
    "use_beam_search": _field(st.booleans()),
    "user": _field(TEXT),
}
TOKENS = st.lists(st.integers(-5, 600), max_size=30)
COMPLETION = st.fixed_dictionaries(
    {
        "prompt": _field(
            st.one_of(TEXT, st.lists(TEXT, max_size=3), TOKENS, st.lists(TOKENS, max_size=3))
        )
    },  # fmt: skip
    optional={
        **COMMON,
        "logprobs": _field(NUM),
        "echo": _field(st.booleans()),
        "suffix": _field(TEXT),
    },  # fmt: skip
)
MESSAGE = st.fixed_dictionaries(
    {"role": _field(ROLES)},
    optional={"content": _field(st.one_of(TEXT, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2)))},
)  # fmt: skip
CHAT = st.fixed_dictionaries(
    {"messages": _field(st.lists(MESSAGE, max_size=3))},
    optional={**COMMON, "logprobs": _field(st.booleans()), "top_logprobs": _field(NUM),
              "add_generation_prompt": _field(st.booleans()),
              "continue_final_message": _field(st.booleans()), "tools": _field(JSON_JUNK)},
)  # fmt: skip


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _check_http(status: int, payload: bytes, body: object) -> None:
    assert status in (200, 400, 413, 429), (status, payload[:500], body)
    if status != 200:
        error = json.loads(payload)["error"]
        assert error["message"], (payload, body)
        return
    if payload.startswith(b"data:"):  # a stream: an error may only travel as an event
        for line in payload.split(b"\n"):
            if line.startswith(b"data: {") and b'"error"' in line:
                error = json.loads(line[6:])["error"]
                assert error["code"] not in ("INTERNAL", "UNKNOWN"), (line, body)
    else:
        assert "choices" in json.loads(payload), (payload, body)


@pytest.mark.parametrize("target", ["replica", "router"])
def test_fuzz_openai_http(cluster: MiniCluster, target: str):
    base = f"http://{_address(cluster, target, http=True)}/v1"

    @FUZZ
    @given(kind=st.sampled_from(["completions", "chat/completions"]), data=st.data())
    def bodies(kind: str, data: st.DataObject) -> None:
        body = data.draw(COMPLETION if kind == "completions" else CHAT)
        status, payload = _post(f"{base}/{kind}", json.dumps(body).encode())
        _check_http(status, payload, body)

    @FUZZ
    @given(raw=st.one_of(st.binary(max_size=200), JSON_JUNK.map(lambda v: json.dumps(v).encode())))
    def raw_bodies(raw: bytes) -> None:
        status, payload = _post(f"{base}/completions", raw)
        _check_http(status, payload, raw)

    bodies()
    raw_bodies()
    _healthy_afterwards(cluster)
