"""One pipelined Redis connection for the per-request lookup (the router's hot path).

redis-py's asyncio client takes a pooled connection, wraps every read in a timeout context
and parses replies through several coroutine layers: about a third of a millisecond per call
on a small machine, most of the router's own overhead. This connection writes commands back to
back on one socket and matches replies in order (Redis answers in order), packing and parsing
with hiredis. It raises redis-py's exception types, so callers handle both clients alike.
Everything else (writes, background refresh) keeps using redis-py.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    import hiredis
except ImportError:  # the router still works through redis-py, only slower
    hiredis = None


def available() -> bool:
    return hiredis is not None


class PipelinedRedis:
    """A single connection; ``call`` may be awaited by many tasks at once."""

    def __init__(self, url: str, timeout_s: float = 0.5) -> None:
        if hiredis is None:
            raise RuntimeError("PipelinedRedis needs the hiredis package")
        opts = parse_url(url)
        self.host = opts.get("host", "127.0.0.1")
        self.port = int(opts.get("port", 6379))
        self.db = int(opts.get("db", 0) or 0)
        self.username = opts.get("username")
        self.password = opts.get("password")
        self.timeout_s = timeout_s
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: deque[asyncio.Future[Any]] = deque()
        self._connecting: asyncio.Lock | None = None

    async def _connect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is not None:
                return
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port), self.timeout_s
                )
            except (OSError, asyncio.TimeoutError) as exc:
                raise RedisConnectionError(f"redis {self.host}:{self.port}: {exc}") from exc
            self._writer = writer
            self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
            if self.password:
                auth = [self.username, self.password] if self.username else [self.password]
                await self._send(("AUTH", *auth))
            if self.db:
                await self._send(("SELECT", self.db))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        parser = hiredis.Reader()
        error: Exception = RedisConnectionError("connection to redis closed")
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    future = self._pending.popleft()
                    if future.done():  # its caller timed out; the reply is dropped
                        continue
                    if isinstance(reply, hiredis.ReplyError):
                        future.set_exception(ResponseError(str(reply)))
                    else:
                        future.set_result(reply)
        except (OSError, hiredis.ProtocolError) as exc:
            error = RedisConnectionError(str(exc))
        finally:
            self._drop(error)

    def _drop(self, error: Exception) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(error)

    async def _send(self, args: tuple[Any, ...]) -> Any:
        writer = self._writer
        if writer is None:
            raise RedisConnectionError("not connected to redis")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append(future)
        writer.write(hiredis.pack_command(args))
        timer = asyncio.get_running_loop().call_later(self.timeout_s, _expire, future)
        try:
            return await future
        finally:
            timer.cancel()

    async def call(self, *args: Any) -> Any:
        """Send one command and await its reply (connecting first if needed)."""
        if self._writer is None:
            await self._connect()
        return await self._send(args)

    async def evalsha(self, sha: str, script: str, args: list[Any]) -> Any:
        """EVALSHA with no keys; on NOSCRIPT (restarted or flushed Redis) load and retry."""
        try:
            return await self.call("EVALSHA", sha, 0, *args)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            await self.call("SCRIPT", "LOAD", script)
            return await self.call("EVALSHA", sha, 0, *args)

    async def close(self) -> None:
        self._drop(RedisConnectionError("closed"))
        if self._reader_task is not None:
            self._reader_task.cancel()


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(RedisTimeoutError("redis did not answer in time"))
