"""The best prefix hit rate any routing could reach on a workload: the unlimited-cache ceiling.

Kept for its callers; the computation (and the capacity-aware ceiling next to it) lives in
``loadtest/ceilings.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.ceilings import ceiling
from loadtest.request import LoadRequest


@dataclass(frozen=True, slots=True)
class BestHitRate:
    prompt_tokens: int
    cacheable_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cacheable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def best_hit_rate(
    measured: list[LoadRequest], block_size: int, warmup: list[LoadRequest] = ()
) -> BestHitRate:
    """Over ``measured`` requests in send order; ``warmup`` requests went earlier and warm the
    cache but do not count."""
    c = ceiling(measured, block_size, None, warmup)
    return BestHitRate(c.prompt_tokens, c.cached_tokens)
