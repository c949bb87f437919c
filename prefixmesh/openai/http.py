"""The OpenAI-compatible HTTP front door of a router or a replica (aiohttp). Torch-free.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or server-sent events
with ``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

The HTTP layer owns no generation logic: it turns each OpenAI request into ``GenerateRequest``
protos and calls its own process's gRPC ``Generator.Generate`` over loopback, the code path
every gRPC client takes, so validation, routing, retries and failover are shared. gRPC status
codes come back as OpenAI error bodies with the matching HTTP status. A client that disconnects
cancels the upstream call, which aborts the request in the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefixmesh.auth import bearer_metadata, bearer_ok
from prefixmesh.limits import RequestLimits, retry_after
from prefixmesh.openai.format import ResponseBuilder, token_text_fn
from prefixmesh.openai.schema import OpenAIError, ParsedRequest, parse_chat, parse_completion
from prefixmesh.tls import TlsFiles, aio_channel
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from prefixmesh.tokenizer import Tokenizer

log = logging.getLogger("prefixmesh.http")

_C = grpc.StatusCode
# gRPC status -> (HTTP status, OpenAI error type).
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    _C.INVALID_ARGUMENT: (400, "invalid_request_error"),
    _C.OUT_OF_RANGE: (400, "invalid_request_error"),
    _C.FAILED_PRECONDITION: (400, "invalid_request_error"),
    _C.UNAUTHENTICATED: (401, "authentication_error"),
    _C.PERMISSION_DENIED: (403, "permission_error"),
    _C.NOT_FOUND: (404, "not_found_error"),
    _C.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    _C.CANCELLED: (499, "cancelled"),
    _C.UNIMPLEMENTED: (501, "not_implemented"),
    _C.UNAVAILABLE: (503, "service_unavailable"),
    _C.DEADLINE_EXCEEDED: (504, "timeout"),
}
_MAX_BODY = 64 * 2**20
REPLICA_HEADER = "X-Prefixmesh-Replica"


def grpc_error(exc: grpc.aio.AioRpcError) -> OpenAIError:
    """An upstream gRPC failure as the OpenAI error a client should see."""
    status, type_ = _STATUS.get(exc.code(), (500, "internal_error"))
    details = exc.details() or exc.code().name
    err = OpenAIError(status, details, _field_named(details, exc.code()), type_, exc.code().name)
    if exc.code() is _C.RESOURCE_EXHAUSTED:  # prefixmesh/limits.py: when to try again
        hint = retry_after(exc.trailing_metadata())
        err.headers["Retry-After"] = hint if hint is not None else "1"
    return err


def _field_named(details: str, code: grpc.StatusCode) -> str | None:
    """The request field an INVALID_ARGUMENT message starts with ("max_tokens must be ...")."""
    if code is not _C.INVALID_ARGUMENT:
        return None
    word = details.split(" ", 1)[0].split("=", 1)[0].strip("'\":,")
    return word if word.replace("_", "").replace(".", "").isalnum() and word.islower() else None


def error_response(err: OpenAIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers or None)


@dataclass(slots=True)
class FrontDoor:
    """What the HTTP layer needs from the process it serves."""

    grpc_target: str  # host:port of this process's own gRPC server
    models: Callable[[], list[str]]  # model ids served (``/v1/models``, response ``model``)
    tokenizer: Callable[[], Tokenizer | None]  # for logprob texts (None: not known yet)
    ready: Callable[[], tuple[bool, dict[str, Any]]]  # ``/health``: ok, details
    registry: CollectorRegistry  # served on ``/metrics``
    api_key: str = ""
    limits: RequestLimits = RequestLimits()  # prefixmesh/limits.py: the body size bound
    tls: TlsFiles = TlsFiles()  # prefixmesh/tls.py: HTTPS, and TLS to its own gRPC port


class _Upstream:
    """The gRPC calls of one HTTP request (one per prompt), merged into one stream of
    ``(prompt index, message)``; ``cancel`` cancels every call still running."""

    def __init__(
        self,
        stub: pb_grpc.GeneratorStub,
        requests: list[pb.GenerateRequest],
        metadata: tuple[tuple[str, str], ...],
    ) -> None:
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.calls = [stub.Generate(r, metadata=metadata or None) for r in requests]
        self.tasks = [asyncio.ensure_future(self._pump(i, c)) for i, c in enumerate(self.calls)]

    async def _pump(self, index: int, call: Any) -> None:
        try:
            async for resp in call:
                self.queue.put_nowait((index, resp))
            self.queue.put_nowait((index, None))
        except grpc.aio.AioRpcError as exc:
            self.queue.put_nowait((index, exc))

    async def __aiter__(self) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        open_calls = len(self.calls)
        while open_calls:
            index, item = await self.queue.get()
            if item is None:
                open_calls -= 1
            elif isinstance(item, grpc.aio.AioRpcError):
                raise grpc_error(item)
            else:
                yield index, item

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()
        for task in self.tasks:
            task.cancel()


def _replica_header(builder: ResponseBuilder) -> dict[str, str]:
    """Which replica(s) served the request (non-standard; shows where a chat stuck)."""
    return {REPLICA_HEADER: ",".join(sorted(builder.replicas))} if builder.replicas else {}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class OpenAIHttpServer:
    """The aiohttp application and its runner, in the caller's event loop."""

    def __init__(self, door: FrontDoor, host: str, port: int) -> None:
        self.door = door
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GeneratorStub | None = None

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.door.limits.max_message_bytes, middlewares=[self._auth]
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with port 0)."""
        self._channel = aio_channel(
            self.door.grpc_target,
            self.door.tls.loopback(),
            options=[
                ("grpc.max_receive_message_length", _MAX_BODY),
                ("grpc.max_send_message_length", _MAX_BODY),
            ],
        )
        self._stub = pb_grpc.GeneratorStub(self._channel)
        # handler_cancellation: a client that goes away cancels its handler, which cancels
        # the upstream call (non-streaming requests included).
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.host, self.port, ssl_context=self.door.tls.http_context()
        )
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1] if sockets else self.port
        log.info("OpenAI HTTP on %s:%d", self.host, self.port)
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- plumbing -----------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/") and not bearer_ok(
            request.headers.get("Authorization"), self.door.api_key
        ):
            return error_response(
                OpenAIError(
                    401,
                    "invalid or missing API key",
                    None,
                    "authentication_error",
                    "invalid_api_key",
                )  # fmt: skip
            )
        return await handler(request)

    def _model(self, asked: str | None) -> str:
        served = self.door.models()
        if asked and (asked in served or not served):
            return asked
        return served[0] if served else (asked or "unknown")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"request body is not valid JSON: {exc}") from exc
        except web.HTTPRequestEntityTooLarge as exc:
            raise OpenAIError(
                413,
                f"request body is larger than {self.door.limits.max_message_bytes} bytes "
                "(the server's --max-message-bytes)",
            ) from exc
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        return body

    # -- endpoints ----------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "prefixmesh"}
            for m in self.door.models()
        ]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        ok, details = self.door.ready()
        return web.json_response(
            {"status": "ok" if ok else "unavailable", **details}, status=200 if ok else 503
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.door.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _generate(
        self, request: web.Request, parse: Callable[[dict[str, Any]], ParsedRequest]
    ) -> web.StreamResponse:
        try:
            body = await self._body(request)
            parsed = parse(body)
        except OpenAIError as err:
            return error_response(err)
        assert self._stub is not None, "start() first"
        builder = ResponseBuilder(
            parsed, self._model(parsed.model), token_text_fn(self.door.tokenizer())
        )
        upstream = _Upstream(self._stub, parsed.requests, bearer_metadata(self.door.api_key))
        messages = aiter(upstream)
        try:
            try:
                first = await anext(messages)
            except OpenAIError as err:  # nothing sent yet: a proper HTTP status
                return error_response(err)
            if not parsed.stream:
                return await self._whole(builder, first, messages)
            return await self._stream(request, builder, first, messages)
        finally:
            upstream.cancel()

    async def _whole(
        self,
        builder: ResponseBuilder,
        first: tuple[int, pb.GenerateResponse],
        messages: AsyncIterator[tuple[int, pb.GenerateResponse]],
    ) -> web.Response:
        builder.add(*first)
        try:
            async for prompt_index, resp in messages:
                builder.add(prompt_index, resp)
        except OpenAIError as err:
            return error_response(err)
        return web.json_response(builder.body(), headers=_replica_header(builder))

    async def _stream(
        self,
        request: web.Request,
        builder: ResponseBuilder,
        first: tuple[int, pb.GenerateResponse],
        messages: AsyncIterator[tuple[int, pb.GenerateResponse]],
    ) -> web.StreamResponse:
        builder.add(*first)  # the first message names the replica for the header
        out = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **_replica_header(builder),
            }
        )
        await out.prepare(request)
        for chunk in builder.chunks(builder.choice_index(*first), first[1]):
            await out.write(_sse(chunk))

        async def send(prompt_index: int, resp: pb.GenerateResponse) -> None:
            index = builder.add(prompt_index, resp)
            for chunk in builder.chunks(index, resp):
                await out.write(_sse(chunk))

        try:
            async for prompt_index, resp in messages:
                await send(prompt_index, resp)
        except OpenAIError as err:  # headers are gone: the error travels as an event
            await out.write(_sse(err.body()))
        else:
            if builder.parsed.include_usage:
                await out.write(_sse(builder.usage_chunk()))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
