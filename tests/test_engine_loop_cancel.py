"""A caller cancelled while its engine command is queued must not fail the engine loop.

Found by the chaos benchmark: when a router died, its replicas' handlers were cancelled while
``submit`` waited for the engine thread; setting a result on the cancelled future raised
``InvalidStateError`` inside the loop, which then failed every request in flight.
"""

from __future__ import annotations

import asyncio

from replica.server.engine_loop import EngineLoop


class _FakeEngine:
    def __init__(self) -> None:
        self.ran: list[str] = []

    def get_stats(self) -> None:
        return None


def test_cancelled_command_is_skipped_and_the_next_one_runs():
    async def go() -> None:
        engine = _FakeEngine()
        loop = EngineLoop(engine, asyncio.get_running_loop())  # thread not started: we drive it
        cancelled = asyncio.ensure_future(loop.call(lambda e: e.ran.append("cancelled")))
        kept = asyncio.ensure_future(loop.call(lambda e: e.ran.append("kept") or 42))
        await asyncio.sleep(0)  # both commands are queued
        cancelled.cancel()
        await asyncio.sleep(0)  # the cancel reaches the concurrent future
        loop._apply_commands()  # what the engine thread does between steps: must not raise
        assert await kept == 42
        assert engine.ran == ["kept"]
        assert cancelled.cancelled()

    asyncio.run(go())
