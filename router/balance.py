"""Requests per replica over a sliding window of this router's recent decisions.

Why: the token load bound (``router/policy.py``) lets a replica take many *warm* requests, which
weigh little in tokens, so one hot prefix can give its replica twice the requests of the others.
Users read balance as requests per replica; the cache-aware policy therefore also bounds each
replica's share of the last ``window`` decisions, which makes a hot prefix spill over to a second
replica (duplicated because it is hot) while cold prefixes stay single.

With several routers each bounds its own share, so the cluster's share is bounded too.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class RecentRequests:
    """The last ``window`` routing decisions, counted per replica."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._ids: deque[str] = deque(maxlen=window)
        self._counts: Counter[str] = Counter()

    def add(self, replica_id: str) -> None:
        if len(self._ids) == self._ids.maxlen:
            old = self._ids[0]
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        self._ids.append(replica_id)
        self._counts[replica_id] += 1

    def count(self, replica_id: str) -> int:
        return self._counts.get(replica_id, 0)

    def __len__(self) -> int:
        return len(self._ids)


class RoutedContent:
    """The distinct prompt blocks this router has sent each replica lately.

    Why: a prompt no replica holds can go anywhere, and where it goes decides what each
    replica's LRU evicts. Sending it to the replica that has been sent the least distinct
    content (sglang-router's "smallest tree") gives every replica the same inflow of new
    blocks, so every pool turns over at the same rate, about as one LRU of the cluster's memory
    would (docs/benchmarks.md, "Cold prompts to the least content").

    The count covers the current epoch and the one before: an epoch ends once
    ``epoch_blocks`` distinct (replica, block) pairs have been sent in it, so memory stays
    bounded (two epochs of hashes) and a replica that joins late catches up within two epochs
    instead of taking every cold prompt until its lifetime count reaches the others'.
    """

    def __init__(self, epoch_blocks: int = 1 << 16) -> None:
        if epoch_blocks < 1:
            raise ValueError(f"epoch_blocks must be >= 1, got {epoch_blocks}")
        self.epoch_blocks = epoch_blocks
        self._current: dict[str, set[bytes]] = {}
        self._previous: dict[str, set[bytes]] = {}
        # Per replica: blocks of the previous epoch not sent again in this one.
        self._previous_only: dict[str, int] = {}
        self._size = 0  # pairs in the current epoch

    def add(self, replica_id: str, hashes: Iterable[bytes]) -> None:
        current = self._current.setdefault(replica_id, set())
        before = len(current)
        previous = self._previous.get(replica_id)
        if previous:
            again = 0
            for h in hashes:
                if h not in current:
                    current.add(h)
                    again += h in previous
            self._previous_only[replica_id] -= again
        else:
            current.update(hashes)
        self._size += len(current) - before
        if self._size >= self.epoch_blocks:
            self._previous, self._current, self._size = self._current, {}, 0
            self._previous_only = {rid: len(s) for rid, s in self._previous.items()}

    def count(self, replica_id: str) -> int:
        """Distinct blocks sent to ``replica_id`` in this epoch and the one before."""
        current = self._current.get(replica_id)
        return (len(current) if current else 0) + self._previous_only.get(replica_id, 0)
