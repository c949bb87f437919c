"""`prefixmesh generate` against an in-process keyed Generator: the key goes as metadata, a wrong
or missing one is a one-line error. (End to end against a real keyed router and replica:
tests/test_openai_http.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from prefixmesh.cli import generate
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

KEY = "sk-generate"


class _KeyedGenerator(pb_grpc.GeneratorServicer):
    """Answers "hello" to the right key; what ApiKeyInterceptor answers to anything else."""

    def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {KEY}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")
        yield pb.GenerateResponse(text="hello", token_ids=[7], replica_id="rep-a")
        final = pb.GenerateResponse(finish_reason="length", replica_id="rep-a")
        final.usage.prompt_tokens, final.usage.completion_tokens = 3, 1
        yield final


@pytest.fixture
def keyed_router(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.delenv("PREFIXMESH_API_KEY", raising=False)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GeneratorServicer_to_server(_KeyedGenerator(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_api_key_flag_and_environment(keyed_router: str, monkeypatch, capsys) -> None:
    assert generate.main(["--router", keyed_router, "--api-key", KEY, "hi"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "hello" and "replica rep-a" in out.err
    monkeypatch.setenv("PREFIXMESH_API_KEY", KEY)
    assert generate.main(["--router", keyed_router, "hi"]) == 0
    assert KEY not in generate.build_parser().format_help()  # the default is read later


def test_missing_or_wrong_key_is_one_clear_line(keyed_router: str, capsys) -> None:
    assert generate.main(["--router", keyed_router, "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"prefixmesh generate: UNAUTHENTICATED: invalid or missing API key (router "
        f"{keyed_router}) (no API key sent: pass --api-key or set PREFIXMESH_API_KEY)"
    )
    assert generate.main(["--router", keyed_router, "--api-key", "wrong", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"prefixmesh generate: UNAUTHENTICATED: invalid or missing API key (router {keyed_router})"
    )
