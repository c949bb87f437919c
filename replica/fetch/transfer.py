"""KV blocks moving between replicas: what leaves a pool and what enters another.

The holder pins the leading blocks a peer asks for (a reference, like a sequence's, so they
cannot be evicted mid-transfer) and reads their KV off the engine thread: a cached block is
full, so the engine never writes it again, and a pinned one is never reallocated. The asker
turns the bytes into tensors off the engine thread too, and the engine only copies them into
fresh blocks and registers them under their hashes (``LLMEngine.import_blocks``), so its KV
events announce them like blocks it computed. Both sides check that every block's tokens chain
to its hash from the asker's ``cache_salt`` root: a peer never gets another tenant's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from prefixmesh.hashing import BlockHash, hash_block, root_hash


class PinnedBlocks(NamedTuple):
    """Leading blocks held for a transfer; ``LLMEngine.unpin`` releases them."""

    pin_id: int
    blocks: list[int]
    hashes: list[BlockHash]
    token_ids: list[tuple[int, ...]]
    parents: Sequence[BlockHash | None] = ()  # ``pin_chains``: the block before each


@dataclass(slots=True)
class FetchedBlocks:
    """Leading blocks of one prompt received from a peer, in order, their KV already in this
    replica's dtype: per layer one tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``
    of keys and one of values (one copy per layer into the pool, not one per block)."""

    hashes: list[BlockHash]
    token_ids: list[tuple[int, ...]]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # The block before each (None: a prompt's first block); empty: ``hashes`` is one chain
    # from the root.
    parents: list[BlockHash | None] = field(default_factory=list)

    def parent(self, i: int) -> BlockHash | None:
        if self.parents:
            return self.parents[i]
        return self.hashes[i - 1] if i else None

    def __len__(self) -> int:
        return len(self.hashes)


def chained_prefix(
    hashes: Sequence[BlockHash],
    token_ids: Sequence[tuple[int, ...] | None],
    model_id: str,
    cache_salt: str,
) -> int:
    """How many leading blocks have tokens that hash, chained from the salt's root, to
    ``hashes``: the blocks a peer asking with ``cache_salt`` may receive."""
    parent = root_hash(model_id, cache_salt)
    for i, (h, tokens) in enumerate(zip(hashes, token_ids)):
        if tokens is None or hash_block(parent, tokens) != h:
            return i
        parent = h
    return min(len(hashes), len(token_ids))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (any dtype: numpy has no bfloat16, bytes do)."""
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def read_blocks(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], blocks: list[int]
) -> list[tuple[list[bytes], list[bytes]]]:
    """Per block, its keys and values per layer as bytes (one gather per layer and side).

    Only for pinned, cached blocks: they are read while the engine thread steps.
    """
    if not blocks:
        return []
    index = torch.tensor(blocks, device=kv_caches[0][0].device)
    n = len(blocks)
    keys: list[list[bytes]] = [[] for _ in range(n)]
    values: list[list[bytes]] = [[] for _ in range(n)]
    for k_cache, v_cache in kv_caches:
        for cache, out in ((k_cache, keys), (v_cache, values)):
            data = tensor_bytes(cache.index_select(0, index))
            size = len(data) // n
            for i in range(n):
                out[i].append(data[i * size : (i + 1) * size])
    return list(zip(keys, values))


def layer_tensor(
    parts: Sequence[bytes], dtype: torch.dtype, block_shape: tuple[int, ...]
) -> torch.Tensor:
    """One layer's keys or values of several blocks, ``[len(parts), *block_shape]``, from each
    block's bytes; ``ValueError`` if a block has the wrong size."""
    expected = torch.tensor([], dtype=dtype).element_size()
    for n in block_shape:
        expected *= n
    for data in parts:
        if len(data) != expected:
            raise ValueError(f"a block layer has {len(data)} bytes, expected {expected}")
    joined = bytearray(b"".join(parts))
    return torch.frombuffer(joined, dtype=dtype).view(len(parts), *block_shape)
