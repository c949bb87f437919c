"""Who may come in: the bounded waiting queue, the requests in flight, and draining.

A request *waits* from admission until it produces its first output; at most ``max_queue``
wait at once, so a saturated replica answers RESOURCE_EXHAUSTED at once and a router can go
elsewhere. While *draining* (after SIGTERM) no request is admitted, and shutdown waits until
the requests in flight are done (``wait_idle``). Lives on the event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio


class Admission:
    """Counts and gates requests for the servicers; the server only starts the drain."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.draining = False
        self.num_waiting = 0  # admitted requests that have not produced output yet
        self.num_inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def queue_full(self) -> bool:
        return self.num_waiting >= self.max_queue

    def enter(self) -> None:
        """A request is admitted: it waits until ``first_output``, is in flight until ``leave``."""
        self.num_inflight += 1
        self.num_waiting += 1
        self._idle.clear()

    def first_output(self) -> None:
        """The request produced its first output: it no longer waits."""
        self.num_waiting -= 1

    def leave(self, still_waiting: bool) -> None:
        """The request is over (done, failed or cancelled)."""
        if still_waiting:
            self.num_waiting -= 1
        self.num_inflight -= 1
        if self.num_inflight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()
