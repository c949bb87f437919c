"""Predicted block entries that expire: replica id -> block hash -> expiry (monotonic seconds).

One type for both tables of predictions a router keeps: its own (router/bookkeeping.py: the
blocks it expects a replica to compute for requests it just sent there) and other routers'
(router/mirror.py, read off the KV event stream). A prediction is a promise with a deadline:
past its expiry a lookup no longer counts it, and ``prune`` forgets it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prefixmesh.hashing import BlockHash


class ExpiringEntries(dict[str, dict[BlockHash, float]]):
    """Per replica, the predicted blocks and when each prediction ends (a plain dict of dicts,
    so a caller may read it as one; the methods are the ways it changes)."""

    def put(self, replica_id: str, hashes: Iterable[BlockHash], expiry: float) -> None:
        """Predict ``hashes`` on the replica until ``expiry`` (replacing earlier expiries)."""
        entries = self.setdefault(replica_id, {})
        for h in hashes:
            entries[h] = expiry

    def extend(self, replica_id: str, hashes: Iterable[BlockHash], expiry: float) -> None:
        """Predict ``hashes`` until ``expiry`` at least (never shortening one)."""
        entries = self.setdefault(replica_id, {})
        for h in hashes:
            entries[h] = max(entries.get(h, 0.0), expiry)

    def shorten(self, replica_id: str, hashes: Iterable[BlockHash], deadline: float) -> None:
        """End the predictions of ``hashes`` by ``deadline`` (those ending sooner stay)."""
        entries = self.get(replica_id)
        if entries:
            for h in hashes:
                if entries.get(h, 0.0) > deadline:
                    entries[h] = deadline

    def drop(self, replica_id: str, hashes: Iterable[BlockHash]) -> None:
        """Forget the predictions of ``hashes`` (the replica announced them: held now)."""
        entries = self.get(replica_id)
        if entries:
            for h in hashes:
                entries.pop(h, None)

    def prune(self) -> None:
        """Forget expired predictions, and replicas left with none."""
        now = time.monotonic()
        for rid, entries in list(self.items()):
            for h in [h for h, expiry in entries.items() if expiry <= now]:
                del entries[h]
            if not entries:
                del self[rid]

    def leading(self, replica_id: str, hashes: Sequence[BlockHash], start: int) -> int:
        """How far the replica's live predictions run on over ``hashes`` from ``start``."""
        matched = start
        entries = self.get(replica_id)
        if entries:
            now = time.monotonic()
            while matched < len(hashes) and entries.get(hashes[matched], 0.0) > now:
                matched += 1
        return matched
