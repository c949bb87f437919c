"""Which cached, unreferenced KV block a replica evicts next: the eviction orders, by name.

A replica's block pool (``replica/block_manager.py``), the routing simulator's pools
(``loadtest/simulate.py``) and the offline ceilings (``loadtest/ceilings.py``) all keep their
cached, unreferenced blocks in one of these orders, keyed by block hash, so the three evict
alike. The pool tells the order what happens to a block (``add`` when it becomes evictable,
``remove`` when a request references it again or it is dropped, ``touch`` when an arriving
request finds it, ``reused`` for a prefix hit, ``missed`` for a wanted block that is gone) and
asks it for a ``victim``.

- ``lru``: least recently used first (vLLM's, SGLang's, Dynamo's and llm-d's rule).
- ``reuse``: ``ReuseOrder`` (``prefixmesh/reuse_order.py``): blocks never reused since they
  were cached go before reused ones, with an adaptive share (ARC-like), leaves before parents.

Both evict a prompt's tail before its root: a pool releases a prompt tail first, and a hit on a
block is a hit on every block before it, so a parent is never less recent nor less reused than
its child.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Protocol

from prefixmesh.reuse_order import ReuseOrder

EVICTION_POLICIES = ("lru", "reuse")
DEFAULT_EVICTION = "lru"


class EvictionOrder(Protocol):
    """The cached, unreferenced blocks of one pool, in the order they are evicted."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __iter__(self) -> Iterator[Hashable]: ...
    def add(self, key: Hashable, parent: Hashable | None = None) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def touch(self, key: Hashable) -> None: ...
    def cached(self, key: Hashable, parent: Hashable | None) -> None: ...
    def reused(self, key: Hashable) -> None: ...
    def missed(self, key: Hashable) -> None: ...
    def forget(self, key: Hashable) -> None: ...
    def victim(self) -> Hashable | None: ...


class LruOrder:
    """Least recently used first; ``add`` and ``touch`` make a block the most recent."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._order)

    def add(self, key: Hashable, parent: Hashable | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def cached(self, key: Hashable, parent: Hashable | None) -> None:
        """LRU does not look at the chain."""

    def reused(self, key: Hashable) -> None:
        """LRU counts recency only."""

    def missed(self, key: Hashable) -> None:
        """LRU keeps no history of evicted blocks."""

    def forget(self, key: Hashable) -> None:
        """``key`` left the cache (evicted or dropped); LRU keeps no history of it."""
        self._order.pop(key, None)

    def victim(self) -> Hashable | None:
        return next(iter(self._order), None)


def make_order(name: str, capacity: int) -> EvictionOrder:
    """The order called ``name`` for a pool of ``capacity`` blocks."""
    if name == "lru":
        return LruOrder()
    if name == "reuse":
        return ReuseOrder(capacity)
    raise ValueError(
        f"unknown eviction policy {name!r}: choose one of {', '.join(EVICTION_POLICIES)}"
    )
