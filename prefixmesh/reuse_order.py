"""The ``reuse`` eviction order: blocks never reused go first, in an adaptive share (ARC-like).

Most cached blocks are never asked for again: single-turn prompts, the tails of conversations
that have ended, generated tokens no later prompt repeats. LRU keeps them as long as the blocks
that do come back. This order keeps two LRU segments of the cached, unreferenced blocks:

- **probation**: blocks no request has found in the cache since they were cached,
- **protected**: blocks some request found (a prefix hit, or a waiting request's prefix).

A victim comes from probation while probation holds more than its target ``p`` blocks, else
from protected. ``p`` adapts as in ARC (Megiddo and Modha, 2003): each segment remembers the
hashes it evicted last (``capacity`` of each, no KV), and a request that misses a block
probation evicted raises ``p`` (probation was too small), one that misses a block protected
evicted lowers it. ``p`` starts at 0: a once-seen block goes before any reused one until the
workload shows that once-seen blocks do come back.

The prefix rule: a block is useless without its parent, so within a segment the victim is the
oldest *leaf* (no child of it is cached and unreferenced here), looked for among the oldest
``SCAN`` blocks. A hit on a block is a hit on every block before it, so a child is never
protected while its parent is on probation; when the segments' order would take a parent first
(its child on probation, the parent protected and older) the leaf rule takes the child.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

SCAN = 64  # oldest blocks of a segment looked at for a leaf before giving up on the rule


class ReuseOrder:
    """Probation and protected LRU segments with an ARC-style adaptive probation target."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.p = 0.0  # probation's target size
        self._probation: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self._protected: OrderedDict[Hashable, None] = OrderedDict()
        self._reused: set[Hashable] = set()  # cached (here or referenced) and found since
        self._parent: dict[Hashable, Hashable] = {}  # evictable key -> its parent
        self._children: dict[Hashable, int] = {}  # evictable children here, per parent
        self._ghost_probation: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost_protected: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected

    def __iter__(self) -> Iterator[Hashable]:
        yield from self._probation
        yield from self._protected

    def add(self, key: Hashable, parent: Hashable | None = None) -> None:
        """``key`` became cached and unreferenced (just used)."""
        segment = self._protected if key in self._reused else self._probation
        segment[key] = None
        segment.move_to_end(key)
        if parent is not None and key not in self._parent:
            self._parent[key] = parent
            self._children[parent] = self._children.get(parent, 0) + 1

    def remove(self, key: Hashable) -> None:
        """``key`` is referenced again: it leaves the order, its reuse is remembered."""
        self._segment(key).pop(key)
        parent = self._parent.pop(key, None)
        if parent is not None:
            n = self._children[parent] - 1
            if n:
                self._children[parent] = n
            else:
                del self._children[parent]

    def touch(self, key: Hashable) -> None:
        self._segment(key).move_to_end(key)

    def cached(self, key: Hashable, parent: Hashable | None) -> None:
        """``key`` was just computed behind ``parent``: a chain that has been extended before
        tends to be extended again (the next turn of a conversation), so the new block of a
        reused chain is protected as its parent is."""
        if parent is not None and parent in self._reused:
            self._reused.add(key)

    def reused(self, key: Hashable) -> None:
        """A request found ``key`` cached: it moves to (or stays in) protected."""
        self._reused.add(key)
        if key in self._probation:
            del self._probation[key]
            self._protected[key] = None

    def missed(self, key: Hashable) -> None:
        """A request wanted ``key`` and it was gone: adapt ``p`` if a segment evicted it."""
        b1, b2 = self._ghost_probation, self._ghost_protected
        if key in b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]

    def forget(self, key: Hashable) -> None:
        """``key`` left the cache (evicted or dropped): remember which segment lost it."""
        if key in self:
            self.remove(key)
        ghost = self._ghost_protected if key in self._reused else self._ghost_probation
        self._reused.discard(key)
        ghost[key] = None
        if len(ghost) > self.capacity:
            ghost.popitem(last=False)

    def victim(self) -> Hashable | None:
        """The oldest leaf of the segment that is over its share; None when empty."""
        if not self._probation and not self._protected:
            return None
        first, second = self._probation, self._protected
        if not first or (len(first) <= self.p and second):
            first, second = second, first
        for segment in (first, second):
            for i, key in enumerate(segment):
                if i >= SCAN:
                    break
                if key not in self._children:
                    return key
        return next(iter(first or second))  # no leaf near the old end: the oldest all the same

    def _segment(self, key: Hashable) -> OrderedDict[Hashable, None]:
        return self._probation if key in self._probation else self._protected
