"""OpenAI request parsing, response building, error mapping and API-key checks, without
processes (the cluster behaviour is in test_openai_http.py)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from prefixmesh.auth import bearer_metadata, bearer_ok
from prefixmesh.openai.format import ResponseBuilder, token_text_fn
from prefixmesh.openai.http import grpc_error
from prefixmesh.openai.schema import (
    CHAT_DEFAULT_MAX_TOKENS,
    OpenAIError,
    parse_chat,
    parse_completion,
)
from proto import prefixmesh_pb2 as pb


def test_every_engine_field_is_mapped_and_unknown_ones_ignored():
    parsed = parse_completion({
        "model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "top_k": 4, "min_p": 0.1, "seed": 3, "stop": "x", "n": 2, "logprobs": 3,
        "ignore_eos": True, "priority": -2, "cache_salt": "t1", "min_tokens": 1,
        "stop_token_ids": [9], "skip_special_tokens": False, "frequency_penalty": 0,
        "stream": True, "stream_options": {"include_usage": True}, "whatever": {"x": 1},
    })  # fmt: skip
    (req,) = parsed.requests
    sp = req.sampling
    assert req.text == "hi" and req.priority == -2 and req.cache_salt == "t1"
    assert (sp.max_tokens, sp.top_k, sp.seed, sp.n, sp.logprobs, sp.min_tokens) == (
        7, 4, 3, 2, 3, 1,
    )  # fmt: skip
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    assert sp.min_p == pytest.approx(0.1) and list(sp.stop) == ["x"]
    assert list(sp.stop_token_ids) == [9] and sp.ignore_eos and not sp.skip_special_tokens
    assert parsed.stream and parsed.include_usage and parsed.n == 2 and parsed.logprobs == 3
    assert parsed.id.startswith("cmpl-") and req.request_id in parsed.id


def test_unset_fields_stay_unset_for_engine_defaults():
    sp = parse_completion({"prompt": "hi"}).requests[0].sampling
    assert not any(sp.HasField(f) for f in ("max_tokens", "temperature", "n", "logprobs"))
    assert not sp.fit_context  # completions keep the default of 16
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.requests[0].sampling.max_tokens == CHAT_DEFAULT_MAX_TOKENS
    assert chat.requests[0].sampling.fit_context  # the replica lowers it to the room left
    assert chat.logprobs is None


def test_prompt_shapes():
    assert [r.text for r in parse_completion({"prompt": ["a", "b"]}).requests] == ["a", "b"]
    (ids,) = parse_completion({"prompt": [1, 2, 3]}).requests
    assert list(ids.token_ids.ids) == [1, 2, 3]
    two = parse_completion({"prompt": [[1], [2, 3]]}).requests
    assert [list(r.token_ids.ids) for r in two] == [[1], [2, 3]]
    assert len({r.request_id for r in two}) == 2


def test_chat_messages_parts_and_logprobs():
    parsed = parse_chat({
        "messages": [{"role": "system", "content": "s"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 5,
        "continue_final_message": True,
    })  # fmt: skip
    chat = parsed.requests[0].chat
    assert [(m.role, m.content) for m in chat.messages] == [("system", "s"), ("user", "ab")]
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert parsed.logprobs == 2 and parsed.requests[0].sampling.logprobs == 2
    assert parsed.requests[0].sampling.max_tokens == 5 and parsed.id.startswith("chatcmpl-")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_completion_shape_errors_name_the_param(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_completion(body)
    assert err.value.status == 400 and err.value.param == param
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_shape_errors():
    for body, param in (
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools"),
    ):  # fmt: skip
        with pytest.raises(OpenAIError) as err:
            parse_chat(body)
        assert err.value.param == param


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return f"<{ids[0]}>"


def _resp(index, ids, text, finish="", prompt=0, cached=0, top=(), fetched=0):
    resp = pb.GenerateResponse(index=index, token_ids=ids, text=text, finish_reason=finish,
                               replica_id="r0")  # fmt: skip
    for t in ids:
        resp.logprobs.append(pb.Logprobs(token_id=t, logprob=-0.5,
                                         top=[pb.TokenLogprob(token_id=u, logprob=-1.0)
                                              for u in top]))  # fmt: skip
    if finish:
        resp.usage.prompt_tokens, resp.usage.cached_tokens = prompt, cached
        resp.usage.fetched_tokens = fetched
        resp.usage.completion_tokens = len(ids) + 1
    return resp


def test_completion_body_usage_and_logprobs_over_prompts_and_samples():
    parsed = parse_completion({"prompt": ["a", "b"], "n": 2, "logprobs": 1})
    builder = ResponseBuilder(parsed, "m", token_text_fn(_Tok()))
    for p in (0, 1):
        for i in (0, 1):
            builder.add(p, _resp(i, [7], "x", top=(8,)))
            builder.add(p, _resp(i, [9], "y", "length", prompt=10, cached=4 + i, fetched=i))
    body = builder.body()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "xy" and c["finish_reason"] == "length" for c in body["choices"])
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<7>", "<9>"] and lp["text_offset"] == [0, 3]
    assert lp["top_logprobs"][0] == {"<8>": -1.0}
    # Each prompt counted once (the best cached count of its samples), all samples' tokens.
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28,
                             "prompt_tokens_details": {"cached_tokens": 10,
                                                       "fetched_tokens": 2}}  # fmt: skip


def test_chat_chunks_start_with_the_role_and_end_with_the_reason():
    parsed = parse_chat({"messages": [{"role": "user", "content": "q"}], "logprobs": True})
    builder = ResponseBuilder(parsed, "m", token_text_fn(None))
    first = builder.chunks(builder.add(0, _resp(0, [5], "he")), _resp(0, [5], "he"))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first[1]["choices"][0]["delta"] == {"content": "he"}
    assert first[1]["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:5"
    last = _resp(0, [], "", "stop", prompt=3)
    (end,) = builder.chunks(builder.add(0, last), last)
    assert end["choices"][0]["finish_reason"] == "stop" and end["choices"][0]["delta"] == {}
    assert builder.usage_chunk()["choices"] == [] and builder.usage()["prompt_tokens"] == 3


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code, details=None):
        super().__init__(code, None, None, details=details or f"{code.name} details")


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_grpc_status_maps_to_http_status(code, status):
    err = grpc_error(_RpcError(code))
    assert err.status == status and err.code == code.name and "details" in err.message


@pytest.mark.parametrize(
    ("details", "param"),
    [
        ("max_tokens must be >= 1 (got 0)", "max_tokens"),
        ("top_p must be in (0, 1] (got 1.5)", "top_p"),
        ("prompt is 9000 tokens, longer than the model's context", "prompt"),
        ("Bad request", None),
    ],
)
def test_invalid_argument_names_the_param(details, param):
    err = grpc_error(_RpcError(grpc.StatusCode.INVALID_ARGUMENT, details))
    assert err.param == param and err.body()["error"]["param"] == param


def test_bearer_check():
    assert bearer_ok(None, "") and bearer_ok("anything", "")
    assert bearer_ok("Bearer k1", "k1") and not bearer_ok("Bearer k2", "k1")
    assert not bearer_ok("k1", "k1") and not bearer_ok(None, "k1")
    assert bearer_metadata("k1") == (("authorization", "Bearer k1"),) and bearer_metadata("") == ()


class _FakeGenerator:
    """A gRPC Generator that streams one token, then fails with ``code`` (or at once)."""

    def __init__(self, code: grpc.StatusCode, tokens_first: int) -> None:
        self.code, self.tokens_first = code, tokens_first

    async def Generate(self, request, context):  # noqa: N802
        for _ in range(self.tokens_first):
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[1], text="a")
        await context.abort(self.code, "upstream says no")


async def _with_front_door(code, tokens_first, exercise):
    import aiohttp
    from prometheus_client import CollectorRegistry

    from prefixmesh.openai.http import FrontDoor, OpenAIHttpServer
    from proto import prefixmesh_pb2_grpc as pb_grpc

    server = grpc.aio.server()
    pb_grpc.add_GeneratorServicer_to_server(_FakeGenerator(code, tokens_first), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    door = FrontDoor(f"127.0.0.1:{port}", lambda: ["m"], lambda: None,
                     lambda: (True, {}), CollectorRegistry())  # fmt: skip
    http = OpenAIHttpServer(door, "127.0.0.1", 0)
    await http.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{http.port}") as session:
            return await exercise(session)
    finally:
        await http.close()
        await server.stop(0)


def test_error_before_the_first_token_is_an_http_status():
    async def exercise(session):
        async with session.post("/v1/completions", json={"prompt": "x", "stream": True}) as r:
            return r.status, await r.json()

    status, body = asyncio.run(_with_front_door(grpc.StatusCode.RESOURCE_EXHAUSTED, 0, exercise))
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert body["error"]["message"] == "upstream says no"


def test_error_mid_stream_is_an_error_event_then_done():
    async def exercise(session):
        async with session.post("/v1/completions", json={"prompt": "x", "stream": True}) as r:
            return r.status, (await r.read()).decode()

    status, text = asyncio.run(_with_front_door(grpc.StatusCode.UNAVAILABLE, 1, exercise))
    events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
    assert status == 200 and len(events) == 3
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[1])["error"]["type"] == "service_unavailable"
    assert events[2] == "[DONE]"
