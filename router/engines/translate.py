"""An engine's prefix cache, re-keyed in our chained hash and our block size.

vLLM reports blocks under its own hash, in its own block size. llm-d's lesson: do not share the
engine's hash function, recompute keys from ``token_ids``. Each engine block remembers the
tokens of the prompt after our last full block (``tail``) and our hash of that block
(``last``), so a child block can continue our chain from its parent alone, whatever the two
block sizes are. An engine block *owns* our blocks that become full inside it; our hash is held
while at least one engine block owns it (``_refs``), so duplicates and different block sizes
never drop a hash another engine block still backs.

A ``BlockStored`` whose parent we do not know (it was stored before we started following, or
our view was cleared) cannot be re-keyed: it and its descendants are skipped, which only makes
the view miss blocks, never claim blocks the engine lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixmesh.hashing import BlockHash, packed_block_hashes, root_hash, token_bytes
from prefixmesh.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
)


@dataclass(slots=True)
class _EngineBlock:
    owned: list[BlockHash]  # our hashes that became full inside this engine block
    last: BlockHash  # our hash of the last full block ending at or before this block's end
    tail: bytes  # packed tokens after ``last``'s block, fewer than our block size


@dataclass
class Delta:
    """Our hashes that entered and left the view, in the order events produced them."""

    added: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    cleared: bool = False


class EngineCacheView:
    """One engine's cached blocks in our hash; fed its events strictly in sequence order."""

    def __init__(self, model_id: str, block_size: int) -> None:
        self.model_id = model_id
        self.block_size = block_size
        self._blocks: dict[EngineHash, _EngineBlock] = {}
        self._refs: dict[BlockHash, int] = {}
        self.skipped = 0  # engine blocks we could not re-key (unknown parent)

    @property
    def hashes(self) -> set[BlockHash]:
        return set(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def apply(self, events: list[Event], delta: Delta | None = None) -> Delta:
        """Apply one batch's events in order; returns (or extends) the delta."""
        delta = delta or Delta()
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event, delta)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._removed(_key(h), delta)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
                delta.added.clear()
                delta.removed.clear()
                delta.cleared = True
        return delta

    def clear(self) -> None:
        self._blocks.clear()
        self._refs.clear()

    def _stored(self, event: BlockStored, delta: Delta) -> None:
        size = event.block_size
        model = event.lora_name or self.model_id  # an adapter's KV is not the base model's
        if event.parent_block_hash is None:
            last, tail = root_hash(model), b""
        else:
            parent = self._blocks.get(_key(event.parent_block_hash))
            if parent is None:
                self.skipped += len(event.block_hashes)
                return
            last, tail = parent.last, parent.tail
        packed = token_bytes(event.token_ids)
        step = 4 * self.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            data = tail + packed[4 * size * i : 4 * size * (i + 1)]
            owned = packed_block_hashes(data, self.block_size, model, parent=last)
            if owned:
                last = owned[-1]
            tail = data[len(owned) * step :]
            key = _key(engine_hash)
            if key in self._blocks:  # stored twice without a removal: keep the first
                continue
            self._blocks[key] = _EngineBlock(owned, last, tail)
            for h in owned:
                n = self._refs.get(h, 0)
                self._refs[h] = n + 1
                if n == 0:
                    delta.added.append(h)

    def _removed(self, key: EngineHash, delta: Delta) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            return  # never re-keyed (skipped) or already gone
        for h in block.owned:
            n = self._refs[h] - 1
            if n:
                self._refs[h] = n
            else:
                del self._refs[h]
                delta.removed.append(h)


def _key(h: EngineHash | list[int]) -> EngineHash:
    # msgpack may hand a hash back as a list (a tuple-typed hash in some vLLM releases).
    return tuple(h) if isinstance(h, list) else h  # type: ignore[return-value]
