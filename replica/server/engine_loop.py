"""The thread that owns the engine, and its bridge to the asyncio event loop.

The engine is not thread-safe and ``step()`` is long (a model forward), so one thread owns it:
it applies commands (add, abort, calls) between steps, steps while there is work, and sleeps
on a wakeup event when idle. It holds a lock on the engine's bookkeeping except while idle and
while a step runs the model, which reads only that step's block tables: ``call_now`` takes the
lock from a worker thread, so a short call on the block pool (a peer pinning blocks to read,
fetched blocks going into the prefix cache) need not wait out a prefill step of a second or
more. Each step's outputs go back to the event loop in one
``call_soon_threadsafe`` and land in per-request ``asyncio.Queue``s, so the event loop never
waits on the engine.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from replica.engine_request import EngineRequest
from replica.outputs import StepOutput

if TYPE_CHECKING:
    from replica.engine import EngineStats, LLMEngine

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.02

T = TypeVar("T")


class EngineFailure(RuntimeError):
    """The engine raised inside ``step()``; every in-flight request gets this."""


@dataclass(slots=True)
class _Command:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any] | None = None


@dataclass(slots=True)
class RequestHandle:
    """The event-loop side of one request: its outputs, and when it was first scheduled."""

    request_id: str
    queue: asyncio.Queue[StepOutput | BaseException] = field(default_factory=asyncio.Queue)
    # Set (monotonic seconds) on the engine thread after the first step that includes it.
    scheduled_at: float | None = None


class EngineLoop:
    """Runs ``engine.step()`` on its own thread and streams outputs to asyncio queues.

    ``submit`` and ``call`` are awaited on the event loop; ``abort`` may be called from
    anywhere and returns at once. ``stats`` is the engine's latest ``EngineStats`` (refreshed
    after every step and when idle). Each time it goes idle it checks the engine's block
    accounting and logs an error if it is off (``GetCacheState`` reports the same check).
    """

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._commands: collections.deque[_Command] = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._handles: dict[str, RequestHandle] = {}  # touched on the event loop only
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._lock = threading.Lock()  # the engine's bookkeeping: see the module docstring
        self.stats: EngineStats = engine.get_stats()
        self._stats_at = time.monotonic()

    # -- event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def submit(self, request: EngineRequest) -> RequestHandle:
        """Add a request to the engine; raises the engine's ``ValueError`` on bad input."""
        request_id = request.request_id
        handle = RequestHandle(request_id)
        self._handles[request_id] = handle
        try:
            await self.call(lambda engine: engine.add(request))
        except BaseException:
            self._handles.pop(request_id, None)
            # Cancelled while the add was queued: it may still run, so abort right behind it
            # (commands run in order; aborting an unknown id is a no-op).
            self.abort(request_id)
            raise
        return handle

    def release(self, request_id: str) -> None:
        """Forget a request's queue (outputs still arriving for it are dropped)."""
        self._handles.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request: the engine frees its blocks before its next step."""
        self._post(_Command(lambda engine: engine.abort_request(request_id)))

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread between two steps; returns at once (from any
        thread, and from a ``finally`` of a cancelled task, where nothing may be awaited)."""
        self._post(_Command(fn))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(_Command(fn, future))
        return await asyncio.wrap_future(future, loop=self._loop)

    async def call_now(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on a worker thread as soon as the engine thread is between
        steps, idle or inside a step's model forward, and return its result. Only for short
        calls on the block pool that leave the step's own blocks alone: pinning cached blocks,
        or importing fetched ones into free or evicted blocks (the forward reads and writes
        only blocks its sequences hold, which are never free or evictable)."""
        return await asyncio.to_thread(self._locked, fn)

    def _locked(self, fn: Callable[[LLMEngine], T]) -> T:
        with self._lock:
            return fn(self.engine)

    @contextlib.contextmanager
    def _released(self) -> Iterator[None]:
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step (in-flight requests are left as they are)."""
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_inflight(self) -> int:
        return len(self._handles)

    def _post(self, command: _Command) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _deliver(self, outputs: list[StepOutput], scheduled: list[str], at: float) -> None:
        for request_id in scheduled:
            handle = self._handles.get(request_id)
            if handle is not None and handle.scheduled_at is None:
                handle.scheduled_at = at
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is not None:
                handle.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for handle in self._handles.values():
            handle.queue.put_nowait(error)

    # -- engine-thread side ---------------------------------------------------------------

    def _run(self) -> None:
        self.engine.during_forward = self._released
        try:
            self._loop_until_stopped()
        finally:
            self.engine.during_forward = contextlib.nullcontext

    def _loop_until_stopped(self) -> None:
        busy = False
        while not self._stopping:
            with self._lock:
                try:
                    self._apply_commands()
                    if self.engine.has_unfinished_requests():
                        busy = True
                        self._step()
                        continue
                    if busy:
                        busy = False
                        self._check_integrity()
                    self.stats = self.engine.get_stats()
                except Exception as exc:  # the thread must outlive any engine bug
                    log.exception("engine loop error; failing every in-flight request")
                    self._recover(exc)
                    continue
            self._wakeup.wait()
            self._wakeup.clear()

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            # A caller cancelled while its command was queued (a client gone mid-submit) wants
            # no result; setting one on its cancelled future would raise InvalidStateError
            # here and fail every request in flight. Marking it running also stops a cancel
            # from landing between now and set_result.
            if command.future is not None and not command.future.set_running_or_notify_cancel():
                continue
            try:
                result = command.fn(self.engine)
            except BaseException as exc:  # handed to the caller, never kills the thread
                if command.future is None:
                    log.exception("engine command failed")
                else:
                    command.future.set_exception(exc)
            else:
                if command.future is not None:
                    command.future.set_result(result)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing every in-flight request")
            self._recover(exc)
            return
        scheduled = self._scheduled_request_ids()
        # A stats snapshot walks every sequence: take one per STATS_INTERVAL_S, not per step
        # (readers are the 100 ms lease refresh and metrics; idle refreshes it too).
        now = time.monotonic()
        if now - self._stats_at >= STATS_INTERVAL_S:
            self.stats, self._stats_at = self.engine.get_stats(), now
        if outputs or scheduled:
            self._loop.call_soon_threadsafe(self._deliver, outputs, scheduled, started)

    def _scheduled_request_ids(self) -> list[str]:
        """Requests that got compute for the first time (their queue time ends now)."""
        return self.engine.pop_newly_scheduled()

    def _recover(self, exc: Exception) -> None:
        error = EngineFailure(f"engine step failed: {exc!r}")
        self._loop.call_soon_threadsafe(self._fail_all, error)
        # Drop whatever the engine holds so the next request starts clean.
        self.engine.abort_all()
        time.sleep(0.05)  # a persistent failure must not spin the CPU

    def _check_integrity(self) -> None:
        try:
            self.engine.check_integrity()
        except Exception as exc:  # AssertionError included: logged, not fatal
            log.error("engine integrity check failed at idle: %s: %s", type(exc).__name__, exc)
