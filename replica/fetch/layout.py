"""What two replicas must share for one's KV blocks to be valid in the other: the asker
(``client.py``) checks its peers against it, the holder (``holder.py``) each request."""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.hashing import HASH_SCHEME


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must match between two replicas for a block of one to be valid in the other."""

    model_id: str
    dtype: str  # "bfloat16", "float32", ...
    block_size: int
    hash_scheme: str = HASH_SCHEME

    def mismatch(self, model: str, dtype: str, block_size: int, hash_scheme: str) -> str:
        """Why a peer's blocks do not fit this layout ("" when they do)."""
        for name, mine, theirs in (
            ("model", self.model_id, model),
            ("dtype", self.dtype, dtype),
            ("block_size", self.block_size, block_size),
            ("hash_scheme", self.hash_scheme, hash_scheme),
        ):
            if mine != theirs:
                return f"{name} differs: this replica has {mine!r}, the request {theirs!r}"
        return ""
