"""``GenerateClient`` over OpenAI HTTP: streaming ``POST /v1/completions`` (router or replica).

Each request goes as ``prompt`` = its token ids (or its text, ``--prompt-format text``), with ``max_tokens``, ``ignore_eos``, greedy
sampling and the run's ``cache_salt`` (as the gRPC client sends them), ``stream: true`` and
``stream_options.include_usage``. Server-sent events carry text, not token ids, so per-message
token counts are not on the wire: every text-bearing event is one token-bearing ``Chunk`` (its
arrival gives TTFT and the ITL gaps; prefixmesh sends one event per upstream message that has
text) and the final usage chunk's ``completion_tokens`` gives the runner the exact output length,
so TPOT, output throughput and the hit rate are exact. What HTTP cannot show: a message whose
tokens decode to no text yet (a partial character held back) sends no event, so its arrival is
not seen and the next event's ITL gap spans both. The serving replica comes from the
``X-Prefixmesh-Replica`` response header, cached tokens from
``usage.prompt_tokens_details.cached_tokens``.

Failures raise ``ClientError`` with ``HTTP_<status>`` (e.g. ``HTTP_429``) and the OpenAI error
message; an error event inside a stream becomes ``HTTP_STREAM_<code>`` (the gRPC status name our
server puts in ``code``); a timeout is ``DEADLINE_EXCEEDED``; a refused or lost connection is
``UNAVAILABLE``, as with gRPC.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from loadtest.client import Chunk, ClientError, GenerateClient
from loadtest.request import LoadRequest

REPLICA_HEADER = "X-Prefixmesh-Replica"


def build_body(request: LoadRequest, model: str | None) -> dict[str, Any]:
    """The ``/v1/completions`` body of one load-test request."""
    body: dict[str, Any] = {
        "prompt": request.token_ids if request.text is None else request.text,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    return body


def _error_message(raw: bytes) -> str:
    """The ``error.message`` of an OpenAI error body, else the body's start."""
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except (ValueError, AttributeError):
        pass
    return raw[:300].decode(errors="replace")


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines)."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
        # other fields (event:, id:, retry:) and ":" comments carry nothing we use
    if data:
        yield "\n".join(data)


class HttpClient(GenerateClient):
    """One ``aiohttp.ClientSession`` shared by all requests.

    HTTP/1.1 needs a connection per request in flight, so the pool holds ``max_connections``
    (closed loop: the concurrency) or is unbounded (0: open loop, where capping it would queue
    requests inside the client and hide the server's queueing from TTFT). Idle connections are
    kept alive and reused.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str = "",
        model: str | None = None,
        max_connections: int = 0,
        tls_files: Any = None,
    ) -> None:
        """``tls_files`` (prefixmesh.tls.TlsFiles): ``ca`` verifies an ``https://`` server with
        that CA instead of the system's; ``cert`` and ``key`` answer a server that asks for a
        client certificate (mutual TLS)."""
        self.base_url = base_url.rstrip("/")
        self._ssl = tls_files.client_http_context() if tls_files is not None else None
        self.model = model
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        # Created lazily: a ClientSession belongs to the running event loop.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0, keepalive_timeout=60,
                ssl=self._ssl if self._ssl is not None else True,
            )  # fmt: skip
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, timeout=aiohttp.ClientTimeout()
            )
        return self._session

    async def wait_ready(self, timeout: float) -> None:
        """Wait until ``GET /v1/models`` answers; without ``model``, use the first id listed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = ""
        while True:
            try:
                async with self._http().get(
                    f"{self.base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    raw = await resp.read()
                    if resp.status in (401, 403):
                        raise ClientError(f"HTTP_{resp.status}", _error_message(raw))
                    if resp.status == 200 and self.model is None:
                        models = json.loads(raw).get("data") or []
                        if models and isinstance(models[0], dict):
                            self.model = models[0].get("id")
                    return  # any other answer: the server accepts requests
            except aiohttp.ClientSSLError as e:  # waiting will not make a certificate trusted
                raise ClientError(
                    "UNAVAILABLE",
                    f"TLS with {self.base_url} failed ({e}); pass the CA that signed the "
                    "server's certificate with --tls-ca, and --tls-cert/--tls-key if it wants "
                    "a client certificate",
                ) from e
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                last = repr(e)
            if loop.time() >= deadline:
                msg = f"{self.base_url} not ready after {timeout}s: {last}"
                raise ClientError("UNAVAILABLE", msg)
            await asyncio.sleep(0.2)

    async def stream(self, request: LoadRequest, timeout: float | None) -> AsyncIterator[Chunk]:
        url = f"{self.base_url}/v1/completions"
        try:
            async with self._http().post(
                url,
                data=json.dumps(build_body(request, self.model)),
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if resp.status != 200:
                    raise ClientError(f"HTTP_{resp.status}", _error_message(await resp.read()))
                replica = resp.headers.get(REPLICA_HEADER, "")
                async for chunk in _chunks(resp.content, replica):
                    yield chunk
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise ClientError("DEADLINE_EXCEEDED", f"no answer within {timeout}s") from e
        except aiohttp.ClientConnectionError as e:
            raise ClientError("UNAVAILABLE", repr(e)) from e
        except aiohttp.ClientError as e:
            raise ClientError("HTTP_CLIENT_ERROR", repr(e)) from e

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _chunks(content: aiohttp.StreamReader, replica: str) -> AsyncIterator[Chunk]:
    """``Chunk``s from the SSE stream of one completion (a single choice)."""
    counted = 0
    finish = ""
    async for data in sse_events(content):
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            err = event["error"] if isinstance(event["error"], dict) else {}
            code = err.get("code") or err.get("type") or "ERROR"
            raise ClientError(f"HTTP_STREAM_{code}", str(err.get("message", "")))
        for choice in event.get("choices") or ():
            if choice.get("text"):
                counted += 1
                yield Chunk(num_tokens=1, replica_id=replica)
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage")
        if usage and finish:
            completion = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            # The runner takes the output length from completion_tokens; tokens only count here
            # when no event had text, so that TTFT still has a first token.
            yield Chunk(
                num_tokens=0 if counted else completion,
                finish_reason=finish,
                prompt_tokens=usage.get("prompt_tokens"),
                completion_tokens=completion,
                cached_tokens=details.get("cached_tokens"),
                fetched_tokens=details.get("fetched_tokens"),
                replica_id=replica,
            )
            return
    if finish:  # a server that ignores include_usage: the counted tokens are all we know
        yield Chunk(num_tokens=0, finish_reason=finish, replica_id=replica)
