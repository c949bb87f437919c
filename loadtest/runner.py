"""Sends a workload through a client at the planned times and records what every request saw.

Open loop (arrival times set): a single scheduler coroutine starts each request at its planned
time without waiting for earlier ones, so a slow server builds a queue instead of slowing the
offered load. Closed loop (no times): ``concurrency`` workers each send their next request when
the previous one finishes. Either way the run is bounded: requests planned after
``max_duration`` are not sent and requests still running at ``max_duration + drain_timeout`` are
cancelled (status ``RUN_TIMEOUT``, unlike gRPC's own ``CANCELLED``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.client import ClientError, GenerateClient
from loadtest.request import LoadRequest, RequestResult


@dataclass(frozen=True, slots=True)
class RunLimits:
    """Bounds on one phase of a run (seconds)."""

    max_duration: float = 600.0  # no request is sent after this
    drain_timeout: float = 120.0  # how long to wait for in-flight requests after that
    request_timeout: float | None = 300.0  # gRPC deadline of each request
    concurrency: int = 8  # closed loop only


@dataclass(slots=True)
class PhaseResult:
    """The results of one phase, in request order, and its wall-clock span."""

    results: list[RequestResult]
    started_at: float  # perf_counter at the phase start (results' time origin)
    wall_s: float
    not_sent: int  # requests cut off by max_duration


async def measure(
    client: GenerateClient,
    req: LoadRequest,
    result: RequestResult,
    t0: float,
    timeout: float | None,
) -> None:
    """Send one request and fill ``result`` with its timings (times relative to ``t0``)."""
    clock = time.perf_counter
    result.send_time = clock() - t0
    last: float | None = None
    try:
        async for chunk in client.stream(req, timeout):
            now = clock() - t0
            if chunk.num_tokens:
                if result.first_token_time is None:
                    result.first_token_time = now
                elif last is not None:
                    result.itl.append(now - last)
                last = now
                result.output_tokens += chunk.num_tokens
            if chunk.replica_id:
                result.replica_id = chunk.replica_id
            if chunk.finish_reason:
                result.finish_reason = chunk.finish_reason
                if chunk.prompt_tokens:
                    result.prompt_tokens = chunk.prompt_tokens
                if chunk.completion_tokens:  # HTTP: events carry text, the usage the count
                    result.output_tokens = max(result.output_tokens, chunk.completion_tokens)
                result.cached_tokens = chunk.cached_tokens or 0
                result.fetched_tokens = chunk.fetched_tokens or 0
        if not result.finish_reason:
            result.status = "INCOMPLETE"
    except ClientError as e:
        result.status, result.error = e.status, e.message
    except asyncio.CancelledError:
        result.status, result.error = "RUN_TIMEOUT", "cut off by the run's time limit"
        raise
    except Exception as e:  # a client bug must not kill the whole run
        result.status, result.error = "CLIENT_ERROR", repr(e)
    finally:
        result.end_time = clock() - t0


def _new_result(req: LoadRequest, warmup: bool) -> RequestResult:
    return RequestResult(
        index=req.index,
        warmup=warmup,
        planned_time=req.planned_time,
        prompt_tokens=len(req.token_ids),
        expected_output_tokens=req.max_tokens,
        group=req.group,
        turn=req.turn,
    )


async def run_phase(
    client: GenerateClient,
    requests: list[LoadRequest],
    limits: RunLimits,
    *,
    warmup: bool = False,
    on_done: Callable[[RequestResult], None] | None = None,
) -> PhaseResult:
    """Send ``requests`` (open loop if they have planned times, else closed loop)."""
    closed = any(r.planned_time is None for r in requests)
    results: list[RequestResult] = []
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()

    def launch(req: LoadRequest) -> asyncio.Task[None]:
        result = _new_result(req, warmup)
        results.append(result)
        task = asyncio.create_task(measure(client, req, result, t0, limits.request_timeout))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if on_done is not None:
            task.add_done_callback(lambda _t: on_done(result))
        return task

    queue = iter(requests)
    not_sent = 0

    async def worker() -> None:
        for req in queue:
            if time.perf_counter() - t0 > limits.max_duration:
                return
            await asyncio.shield(launch(req))

    async def open_loop() -> None:
        nonlocal not_sent
        in_order = sorted(requests, key=lambda r: r.planned_time or 0.0)
        for i, req in enumerate(in_order):
            if req.planned_time > limits.max_duration:
                not_sent = len(requests) - i
                return
            delay = req.planned_time - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            launch(req)

    try:
        if closed:
            workers = [asyncio.create_task(worker()) for _ in range(max(1, limits.concurrency))]
            await asyncio.wait_for(asyncio.gather(*workers), limits.max_duration)
        else:
            await open_loop()
    except asyncio.TimeoutError:
        pass
    if closed:
        not_sent = len(requests) - len(results)
    remaining = limits.max_duration + limits.drain_timeout - (time.perf_counter() - t0)
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=max(0.0, remaining))
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    results.sort(key=lambda r: r.index)
    return PhaseResult(results, t0, time.perf_counter() - t0, not_sent)
