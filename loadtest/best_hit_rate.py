"""The best prefix hit rate any routing could reach on a workload.

With one replica and an unlimited cache, a request's prompt finds cached every leading full
block (of the replicas' block size) that an earlier request's prompt already contained. Like the
replicas, the last prompt token is never served from cache (its logits are needed), so only
blocks within the first ``len - 1`` tokens count. Generated tokens are not counted: they are not
known before the run. Hashes come from ``prefixmesh.hashing``, so block identity is exactly what
the replicas and the router see.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.request import LoadRequest
from prefixmesh.hashing import block_hashes

_MODEL_ID = "loadtest"  # any fixed id: only equality of hashes matters here


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
    seen: set[bytes] = set()
    prompt = cacheable = 0
    for counted, reqs in ((False, warmup), (True, measured)):
        for r in reqs:
            max_blocks = (len(r.token_ids) - 1) // block_size
            hashes = block_hashes(r.token_ids, block_size, _MODEL_ID, r.cache_salt or None)
            hits = 0
            for h in hashes[:max_blocks]:
                if h not in seen:
                    break
                hits += 1
            seen.update(hashes)
            if counted:
                prompt += len(r.token_ids)
                cacheable += hits * block_size
    return BestHitRate(prompt, cacheable)
