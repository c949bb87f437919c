"""Chained block hashes shared by the router and the replicas (torch-free).

Block i's hash is ``H(h_{i-1} || tokens of block i)``; the hash before block 0 (the root)
covers the model id, the hash-scheme version and the request's ``cache_salt``, so different
models, scheme versions and tenants never share a block. ``H`` is xxh3-128: a 128-bit digest
makes accidental collisions negligible (about 2^-64 for 2^32 distinct blocks), which matters
because a collision would silently serve another prompt's KV cache.

Only full blocks are hashed. Router and replica must agree bit for bit, so both call this module
and nothing else computes block hashes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

HASH_SCHEME = "xxh3-128-v1"

BlockHash = bytes  # 16-byte xxh3-128 digest


def root_hash(model_id: str, cache_salt: str | None = None) -> BlockHash:
    """The hash that block 0 chains from: model, scheme version and tenant salt."""
    seed = f"{HASH_SCHEME}\0{model_id}\0{cache_salt or ''}".encode()
    return xxhash.xxh3_128_digest(seed)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as the hash reads them: unsigned 32-bit, little-endian."""
    packed = array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """Hash one full block of token ids, chained on its parent's hash."""
    return xxhash.xxh3_128_digest(parent + token_bytes(tokens))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (at most ``max_blocks``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    # Packed once and sliced per block: the same bytes as hash_block's, at a fraction of the
    # cost (the router hashes every prompt on its request path).
    data = token_bytes(token_ids[: num_blocks * block_size])
    return packed_block_hashes(data, block_size, model_id, cache_salt)


def packed_block_hashes(
    data: bytes,
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """``block_hashes`` of tokens already packed by ``token_bytes`` (full blocks only: a
    partial block at the end is ignored). ``parent``: the hash of the block before ``data``'s
    first, when ``data`` continues a prefix already hashed (None: ``data`` starts the prompt)."""
    step = 4 * block_size
    digest = xxhash.xxh3_128_digest
    hashes: list[BlockHash] = []
    if parent is None:
        parent = root_hash(model_id, cache_salt)
    for start in range(0, len(data) // step * step, step):
        parent = digest(parent + data[start : start + step])
        hashes.append(parent)
    return hashes


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Append the hashes of blocks that became full since ``hashes`` was computed (in place)."""
    parent = hashes[-1] if hashes else root_hash(model_id, cache_salt)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
