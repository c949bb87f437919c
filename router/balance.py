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
