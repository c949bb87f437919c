"""The KV event stream: how routers follow the block sets without asking Redis per request.

One Redis stream per namespace (``redis_layout.kv_events_key``). Every writer of a block set
appends an entry *in the same MULTI* as the set change, so the stream and the sets never
disagree at any stream id. Entry fields (all bytes):

- ``k``: the kind. ``d`` a delta (``a`` added, ``r`` removed hashes), ``s`` a reset (the replica
  rewrote its whole set: readers re-read it), ``p`` predicted blocks a router just routed to
  (``a`` the hashes, ``t`` their TTL in ms, ``o`` the router's id).
- ``i``: the replica id; ``e``: the replica's epoch (``d`` and ``s``).
- ``n``: the replica's event sequence number (``d`` and ``s``): 1, 2, 3... per epoch, and the
  same number is written to the lease's ``kv_seq`` field in the same MULTI. A reader that sees
  ``n`` jump, or the lease's ``kv_seq`` ahead of what it applied, has missed an event.
- ``a``, ``r``: raw 16-byte block hashes, concatenated.

The stream is capped (``XADD MAXLEN ~``) and expires with the block sets when every writer is
gone: Redis memory stays bounded. A reader that falls behind the cap loses events and finds out
through ``n`` or ``kv_seq``; it then re-reads the sets, which stay the source of truth.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prefixmesh import redis_layout as layout

HASH_LEN = 16
DELTA, RESET, PREDICTED = b"d", b"s", b"p"


def queue_event(
    pipe: Any,
    ns: str,
    replica_id: str,
    epoch: str,
    seq: int,
    *,
    reset: bool = False,
    added: Iterable[bytes] = (),
    removed: Iterable[bytes] = (),
) -> None:
    """Queue a replica's event (and its ``kv_seq``) on ``pipe``, next to the set change."""
    fields = {"k": RESET if reset else DELTA, "i": replica_id, "e": epoch, "n": seq}
    if not reset:
        fields["a"] = b"".join(added)
        fields["r"] = b"".join(removed)
    _xadd(pipe, ns, fields)
    lease = layout.lease_key(replica_id, ns)
    pipe.hset(lease, "kv_seq", seq)
    # After a flush this HSET recreates the lease with kv_seq alone (no address: routers skip
    # it) until the replica's refresh rewrites it: it must still expire if the replica dies.
    pipe.pexpire(lease, layout.LEASE_TTL_MS)


def queue_predicted(
    pipe: Any, ns: str, router_id: str, replica_id: str, hashes: Iterable[bytes], ttl_ms: int
) -> None:
    """Queue a router's predicted entries, so that other routers' mirrors see them too."""
    fields = {"k": PREDICTED, "i": replica_id, "o": router_id, "t": ttl_ms}
    fields["a"] = b"".join(hashes)
    _xadd(pipe, ns, fields)


def _xadd(pipe: Any, ns: str, fields: dict[str, Any]) -> None:
    key = layout.kv_events_key(ns)
    pipe.xadd(key, fields, maxlen=layout.KV_EVENTS_MAXLEN, approximate=True)
    pipe.pexpire(key, layout.BLOCKS_TTL_MS)


def split_hashes(blob: bytes) -> list[bytes]:
    return [blob[i : i + HASH_LEN] for i in range(0, len(blob), HASH_LEN)]


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One parsed stream entry."""

    kind: bytes
    replica_id: str
    epoch: str = ""
    seq: int = 0
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    router_id: str = ""
    ttl_ms: int = 0

    @classmethod
    def parse(cls, fields: dict[bytes, bytes]) -> KVEvent:
        return cls(
            kind=fields.get(b"k", b""),
            replica_id=fields.get(b"i", b"").decode(),
            epoch=fields.get(b"e", b"").decode(),
            seq=int(fields.get(b"n", 0) or 0),
            added=tuple(split_hashes(fields.get(b"a", b""))),
            removed=tuple(split_hashes(fields.get(b"r", b""))),
            router_id=fields.get(b"o", b"").decode(),
            ttl_ms=int(fields.get(b"t", 0) or 0),
        )


def stream_id(value: bytes | str) -> tuple[int, int]:
    """A stream id (``ms-seq``) as a comparable tuple; ``0-0`` for none."""
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms or 0), int(seq or 0)
