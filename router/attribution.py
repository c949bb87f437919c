"""Why a prompt block was not served from cache: miss attribution.

Every routed request is split, block by block, into hits and four kinds of miss, from what the
router knew when it routed the request and what the replica then reported (``usage.
cached_tokens``). Only the blocks that could be hits count: full blocks within the first
``len - 1`` prompt tokens (the last token is always computed, its logits are needed).

- **stale**: the map said the chosen replica held the block (cached, or predicted: being
  computed for an earlier request), and the replica did not serve it;
- **elsewhere**: the chosen replica did not hold it, but another live replica did (or was
  computing it): the request was sent away for load or spillover;
- **evicted**: no replica held it, but some earlier request routed by this router contained it,
  so a replica computed it once and has since evicted it;
- **compulsory**: never seen before (the unlimited-cache ceiling's misses).

Blocks are chained (a block's hash covers every token before it), so each kind is a range of
block positions: ``[0, served)`` hits, then stale up to what the map promised on the chosen
replica, elsewhere up to the deepest prefix another replica held, evicted up to the deepest
prefix ever seen, compulsory beyond. A replica that serves *more* than the map promised (its
KV events were late) just leaves fewer misses.

"Seen" is this router's memory (a bounded set of block hashes it routed); with several routers
a block first routed by another one counts as compulsory here, not evicted. The memory keeps the
262,144 most recently routed hashes (~40 MB): a block last routed before that counts as
compulsory too.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

STALE, ELSEWHERE, EVICTED, COMPULSORY = "stale", "elsewhere", "evicted", "compulsory"
MISS_KINDS = (COMPULSORY, EVICTED, ELSEWHERE, STALE)


class PendingMisses(NamedTuple):
    """What the router knew at routing time; ``split`` finishes it with the replica's report."""

    block_size: int
    cacheable_blocks: int  # full blocks within the first len - 1 prompt tokens
    promised_blocks: int  # leading blocks the map said the chosen replica holds or computes
    elsewhere_blocks: int  # the deepest leading prefix another replica held or computed
    seen_blocks: int  # leading blocks of the prompt some earlier routed request contained

    def split(self, cached_tokens: int) -> dict[str, int]:
        """Block counts per miss kind (plus ``hit``) given the tokens the replica served."""
        n = self.cacheable_blocks
        served = min(n, -(-max(0, cached_tokens) // self.block_size)) if self.block_size else 0
        bounds = (
            (STALE, min(n, self.promised_blocks)),
            (ELSEWHERE, min(n, max(self.promised_blocks, self.elsewhere_blocks))),
            (EVICTED, min(n, max(self.promised_blocks, self.elsewhere_blocks, self.seen_blocks))),
            (COMPULSORY, n),
        )
        out = {"hit": served}
        low = served
        for kind, high in bounds:
            out[kind] = max(0, high - low)
            low = max(low, high)
        return out


class MissAttribution:
    """Bounded memory of routed block hashes, and the window's counts per miss kind."""

    def __init__(self, max_seen: int = 262_144) -> None:
        self.max_seen = max_seen
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def seen_prefix(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._seen:
                break
            n += 1
        return n

    def remember(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            if h in self._seen:
                self._seen.move_to_end(h)
            else:
                self._seen[h] = None
        while len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)

    def pending(
        self,
        hashes: Sequence[bytes],
        prompt_tokens: int,
        block_size: int,
        promised_blocks: int,
        elsewhere_blocks: int,
    ) -> PendingMisses | None:
        """Attribution state for one routing decision (None for an untokenized request); the
        request's blocks are remembered as seen from now on."""
        if prompt_tokens <= 0 or block_size <= 0:
            return None
        cacheable = min(len(hashes), (prompt_tokens - 1) // block_size)
        # seen_prefix, then remember, in one pass (this runs on every routed request): the
        # leading run of seen hashes is counted before any of the request's is added.
        seen, move = self._seen, self._seen.move_to_end
        leading, counting = 0, True
        for h in hashes:
            if h in seen:
                move(h)
                leading += counting
            else:
                counting = False
                seen[h] = None
        while len(seen) > self.max_seen:
            seen.popitem(last=False)
        return PendingMisses(block_size, cacheable, promised_blocks, elsewhere_blocks, leading)

    def settle(self, pending: PendingMisses | None, cached_tokens: int) -> dict[str, int]:
        """Count one finished request; returns its split (empty for None)."""
        if pending is None:
            return {}
        split = pending.split(cached_tokens)
        self.counts.update(split)
        return split

    def reset(self) -> None:
        """A new stats window: counts restart, the memory of seen blocks stays."""
        self.counts = Counter()

    def snapshot(self) -> dict[str, int]:
        """Counts per miss kind, plus ``hit`` and ``cacheable`` (blocks attributed)."""
        out = {k: self.counts.get(k, 0) for k in (*MISS_KINDS, "hit")}
        out["cacheable"] = sum(out.values())
        return out
