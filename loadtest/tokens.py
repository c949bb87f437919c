"""Deterministic synthetic token ids: one fixed block per id, so equal ids give equal prefixes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# SmolLM2's vocabulary; ids below 100 hold its special and control tokens.
DEFAULT_VOCAB_SIZE = 49152
DEFAULT_MIN_TOKEN_ID = 100


@dataclass
class TokenBlocks:
    """Maps a block id (a Mooncake hash id, a group's system prompt ...) to token ids.

    The tokens of block ``b`` come from a PRNG seeded by ``(seed, namespace, b)`` and lie in
    ``[min_token_id, vocab_size)``, so special tokens never appear and any two requests naming the
    same block get byte-identical token ids (hence identical block hashes on the replicas).
    """

    block_len: int
    vocab_size: int = DEFAULT_VOCAB_SIZE
    min_token_id: int = DEFAULT_MIN_TOKEN_ID
    seed: int = 0
    _cache: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.block_len < 1:
            raise ValueError(f"block length must be >= 1 (got {self.block_len})")
        if not 0 <= self.min_token_id < self.vocab_size:
            raise ValueError(
                f"need 0 <= min_token_id < vocab_size (got {self.min_token_id}, {self.vocab_size})"
            )

    def block(self, block_id: int, namespace: int = 0) -> list[int]:
        key = (namespace, block_id)
        tokens = self._cache.get(key)
        if tokens is None:
            tokens = self.random(self.block_len, block_id, namespace)
            self._cache[key] = tokens
        return tokens

    def random(self, length: int, *key: int) -> list[int]:
        """``length`` tokens from a PRNG seeded by ``(seed, *key)`` (not cached)."""
        rng = np.random.default_rng([self.seed, *(int(k) & 0xFFFFFFFF for k in key)])
        return rng.integers(self.min_token_id, self.vocab_size, size=length).tolist()
