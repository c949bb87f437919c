"""Belady's MIN under the prefix rule: the offline-optimal eviction order for the ceilings.

Knowing every request to come, evict the cached block whose next use is farthest away (never:
farthest of all). Under the prefix rule a request that uses a block uses every block before it,
so a parent's next use is never later than its child's; on a tie the deeper block goes first,
so a parent always outlives its children and no orphan is left. ``loadtest/ceilings.py`` runs
its one cache with this order for the third ceiling: what the same memory keeps when the victims
are chosen perfectly, the headroom over LRU that a better eviction policy could win.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Hashable, Iterator, Sequence


class BeladyOrder:
    """Cached, unreferenced blocks, evicted farthest next use first (set ``now`` per request)."""

    def __init__(self, uses: dict[Hashable, list[int]]) -> None:
        self.uses = uses  # hash -> the sorted request indices that can hit it
        self.now = 0  # the index of the request running now
        self._next: dict[Hashable, tuple[float, int]] = {}  # evictable key -> its heap key
        self._depth: dict[Hashable, int] = {}
        self._heap: list[tuple[float, int, int, Hashable]] = []
        self._pushes = 0

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, key: object) -> bool:
        return key in self._next

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._next)

    def next_use(self, key: Hashable) -> float:
        """The first request after ``now`` that can hit ``key`` (inf: none)."""
        times = self.uses.get(key)
        if not times:
            return math.inf
        i = bisect.bisect_right(times, self.now)
        return times[i] if i < len(times) else math.inf

    def add(self, key: Hashable, parent: Hashable | None = None) -> None:
        depth = self._depth.get(parent, -1) + 1 if parent is not None else 0
        self._depth[key] = depth
        self._push(key)

    def _push(self, key: Hashable) -> None:
        nxt = (self.next_use(key), self._depth.get(key, 0))
        self._next[key] = nxt
        self._pushes += 1
        heapq.heappush(self._heap, (-nxt[0], -nxt[1], self._pushes, key))

    def remove(self, key: Hashable) -> None:
        del self._next[key]

    def touch(self, key: Hashable) -> None:
        self._push(key)

    def cached(self, key: Hashable, parent: Hashable | None) -> None:
        """MIN needs no history."""

    def reused(self, key: Hashable) -> None:
        """MIN needs no history."""

    def missed(self, key: Hashable) -> None:
        """MIN needs no history."""

    def forget(self, key: Hashable) -> None:
        self._next.pop(key, None)
        self._depth.pop(key, None)

    def victim(self) -> Hashable | None:
        heap = self._heap
        while heap:
            neg_next, neg_depth, _, key = heap[0]
            if self._next.get(key) == (-neg_next, -neg_depth):
                # The key's next use may have passed since it was pushed: refresh and retry.
                if self.next_use(key) != -neg_next:
                    heapq.heappop(heap)
                    self._push(key)
                    continue
                return key
            heapq.heappop(heap)
        return None


def use_times(hash_lists: Sequence[Sequence[Hashable]]) -> dict[Hashable, list[int]]:
    """hash -> the indices (in order) of the requests whose hit range holds it."""
    uses: dict[Hashable, list[int]] = {}
    for i, hashes in enumerate(hash_lists):
        for h in hashes:
            uses.setdefault(h, []).append(i)
    return uses
