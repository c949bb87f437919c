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
from dataclasses import dataclass
from typing import NamedTuple

import torch

from prefixmesh.hashing import BlockHash, hash_block, root_hash


class PinnedBlocks(NamedTuple):
    """Leading blocks held for a transfer; ``LLMEngine.unpin`` releases them."""

    pin_id: int
    blocks: list[int]
    hashes: list[BlockHash]
    token_ids: list[tuple[int, ...]]


@dataclass(slots=True)
class FetchedBlock:
    """One block received from a peer, its KV already in this replica's dtype and shape."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer, [block_size, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def chained_prefix(
    hashes: Sequence[BlockHash],
    token_ids: Sequence[tuple[int, ...] | None],
    model_id: str,
    cache_salt: str | None,
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
    gathered = [(k.index_select(0, index).cpu(), v.index_select(0, index).cpu())
                for k, v in kv_caches]  # fmt: skip
    return [
        ([tensor_bytes(k[i]) for k, _ in gathered], [tensor_bytes(v[i]) for _, v in gathered])
        for i in range(len(blocks))
    ]


def block_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """One layer's keys or values from their bytes; ``ValueError`` if the size is wrong."""
    size = torch.tensor([], dtype=dtype).element_size()
    expected = size
    for n in shape:
        expected *= n
    if len(data) != expected:
        raise ValueError(f"a block layer has {len(data)} bytes, expected {expected}")
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
