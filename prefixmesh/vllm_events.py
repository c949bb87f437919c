"""vLLM's KV cache event messages, as they travel over ZMQ + msgpack (torch-free).

The de facto format that vLLM engines publish (``--kv-events-config``) and that Dynamo's KV
router and llm-d's precise prefix-cache scorer consume. Written from vLLM's message definitions
(``vllm/distributed/kv_events.py``), not copied:

- a ZMQ PUB message is three frames ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian
  unsigned number counting from 0 per publisher, ``payload`` one msgpack ``EventBatch``;
- ``EventBatch`` is an array ``[ts, events, data_parallel_rank]`` (the rank may be omitted);
- each event is a map tagged by ``type`` (msgspec's ``tag=True``): ``BlockStored``
  ``{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...}``,
  ``BlockRemoved{block_hashes, medium}``, ``AllBlocksCleared{}``. Older vLLM releases sent the
  events as arrays ``[type, field, ...]`` in field order; both are read. Unknown event types
  and extra fields are ignored, so newer engines still parse;
- the replay socket is a ROUTER: a DEALER sends ``(b"", start_seq)`` and gets every buffered
  ``(b"", topic, seq, payload)`` from ``start_seq`` on, then ``(b"", b"", END_SEQ, b"")``.

Block hashes are opaque to us (ints or bytes, the engine's own hash): the router re-keys blocks
from ``token_ids`` with its chained hash (``router/engines/translate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

END_SEQ = (-1).to_bytes(8, "big", signed=True)
EngineHash = int | bytes

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name")  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium")


class EventFormatError(ValueError):
    """A message that does not follow vLLM's KV event format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the engine's prefix cache: ``token_ids`` fill them in order."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the engine's prefix cache."""

    block_hashes: list[EngineHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: the events of one engine step, in order."""

    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _event_to_wire(event: Event) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        body = {name: getattr(event, name) for name in _STORED_FIELDS}
    elif isinstance(event, BlockRemoved):
        body = {name: getattr(event, name) for name in _REMOVED_FIELDS}
    else:
        body = {}
    return {"type": type(event).__name__, **body}


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of ``batch``, as vLLM's msgspec encoder writes it."""
    wire: list[Any] = [batch.ts, [_event_to_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        wire.append(batch.data_parallel_rank)
    return msgpack.packb(wire, use_bin_type=True)


def _event_from_wire(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind = raw.get("type")
        body = raw
    elif isinstance(raw, (list, tuple)) and raw:
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        body = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventFormatError(f"a KV event must be a map or an array, got {type(raw).__name__}")
    if kind == "BlockStored":
        try:
            return BlockStored(**{name: body.get(name) for name in _STORED_FIELDS})
        except TypeError as exc:
            raise EventFormatError(f"bad BlockStored: {exc}") from exc
    if kind == "BlockRemoved":
        return BlockRemoved(list(body.get("block_hashes") or []), body.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a newer event type: not ours to interpret


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one payload; raises ``EventFormatError`` on anything that is not an EventBatch."""
    try:
        wire = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise EventFormatError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(wire, (list, tuple)) or len(wire) < 2 or not isinstance(wire[1], list):
        raise EventFormatError("an EventBatch is an array [ts, events, data_parallel_rank]")
    events = [e for e in map(_event_from_wire, wire[1]) if e is not None]
    for e in events:
        if isinstance(e, BlockStored) and (not isinstance(e.block_size, int) or e.block_size < 1):
            raise EventFormatError(f"BlockStored.block_size must be >= 1, got {e.block_size!r}")
    rank = wire[2] if len(wire) > 2 else None
    return EventBatch(float(wire[0]), events, rank)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def parse_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventFormatError(f"the sequence frame is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")
