"""A peer's pin, and a fetch's import, do not wait out a step: they run during its forward.

A prefill step of SmolLM2 on two cores takes a second or more. A fetch whose pin waited for
the holder's step timed out into a full recompute on the asking replica (docs/benchmarks.md,
"Fetch weight on the real model"), and an import that waited for the asker's own step put the
request one step later. The engine thread releases its lock on the engine's bookkeeping for the
forward (``EngineLoop.call_now``).
"""

from __future__ import annotations

import asyncio
import threading

from helpers import blocks_held_by

from prefixmesh.hashing import block_hashes
from replica import LLM, SamplingParams
from replica.engine_request import EngineRequest
from replica.server.engine_loop import EngineLoop

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def collect(handle) -> list[int]:
    tokens: list[int] = []
    while True:
        out = await asyncio.wait_for(handle.queue.get(), timeout=30)
        tokens += out.new_token_ids
        if out.finished:
            return tokens


def test_pins_and_imports_run_during_a_step_forward_and_a_plain_call_waits(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    peer = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    held = list(range(5, 45))  # 2 full blocks, cached here once generated
    busy = list(range(100, 160))  # the request whose step's forward the test holds open
    fetched = list(range(200, 250))  # 3 full blocks, held by the peer only
    alone = [o.token_ids for o in llm.generate([held, busy, fetched], GREEDY)]
    engine.reset_prefix_cache()
    llm.generate([held], GREEDY)
    peer.generate([fetched], GREEDY)
    from_peer = blocks_held_by(peer.engine, engine, fetched)
    hashes = block_hashes(held, engine.block_manager.block_size, engine.model_id)
    in_forward, resume = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def held_forward(sched):
        in_forward.set()
        assert resume.wait(30), "the test never let the forward go on"
        return execute(sched)

    engine.runner.execute = held_forward

    async def go() -> None:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            handle = await loop.submit(EngineRequest("busy", busy, GREEDY))
            assert await asyncio.to_thread(in_forward.wait, 30)
            plain = asyncio.ensure_future(loop.call(lambda e: "after the step"))
            pinned = await asyncio.wait_for(
                loop.call_now(lambda e: e.pin_prefix(hashes, None)), timeout=10
            )
            assert len(pinned.blocks) == 2 and engine.num_pinned_blocks == 2
            imported = await asyncio.wait_for(
                loop.call_now(lambda e: e.import_blocks(from_peer)), timeout=10
            )
            assert imported == 3
            await asyncio.sleep(0.1)
            assert not plain.done()  # still inside the same forward
            resume.set()
            assert await asyncio.wait_for(plain, timeout=30) == "after the step"
            await loop.call_now(lambda e: e.unpin(pinned.pin_id))
            # Neither changed what the step computed, and the imported prefix is a cache hit
            # with the cold run's output.
            assert await collect(handle) == alone[1]
            hits = engine.scheduler.stats.prefix_cache_hits
            assert await collect(await loop.submit(EngineRequest("f", fetched, GREEDY))) == alone[2]
            assert engine.scheduler.stats.prefix_cache_hits - hits == 48
            await loop.call(lambda e: e.check_integrity())
            assert engine.num_pinned_blocks == 0
        finally:
            resume.set()
            loop.stop()

    asyncio.run(go())
