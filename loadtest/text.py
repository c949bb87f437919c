"""Deterministic text prompts: one fixed sentence per block id, for routers that match text.

Some routers (sglang-router) refuse a ``prompt`` of token ids and match prefixes on the text
itself. ``TextBlocks`` turns every block id (a Mooncake hash id) into one fixed sentence of
``words_per_block`` common English words, each of which is a single token with its leading space
in SmolLM2's (and most BPE) vocabularies, so a sentence is about one block of tokens. Requests
that share hash ids share their leading sentences verbatim, so the trace's prefix tree survives
as text: a text-matching router and a token-matching one see the same shared prefixes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Common lower-case English words; each is one token (with its leading space) for SmolLM2.
WORDS = tuple(
    dict.fromkeys(
        """
    the of and to in is was for on that with as by at from his it an were are which this be
    has had not but or have first one their its new after who they two her she been other when
    there all during into school time may years more most only over city some world would where
    later up such used many can state about national out known university united then made
    however also year three part team game film season people north south river high well
    since while both between second each family under these early before through being until
    four name area county center around government group power life house history work own
    line order film water small large great long good little last home way day night land war
    book song music club field place side end music public album days line king church road
    river local river west east number series black white red blue green five six ten free
    market court light paper story army party point game board town art
    """.split()
    )
)


@dataclass
class TextBlocks:
    """Maps a block id to one fixed sentence (``' w1 w2 ... wn.'``, a leading space included).

    Words are drawn from ``WORDS`` by a PRNG seeded by ``(seed, namespace, block id)``, so the
    same id always gives the same sentence, in every run and process. Sentences concatenate
    into a prompt; ``prefix(b, k)`` is the first ``k`` words of block ``b``'s sentence, for a
    prompt whose last block is cut short.
    """

    words_per_block: int = 15  # + the full stop: about 16 tokens
    seed: int = 0
    _cache: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.words_per_block < 1:
            raise ValueError(f"words per block must be >= 1 (got {self.words_per_block})")

    def words(self, block_id: int, namespace: int = 0) -> tuple[str, ...]:
        key = (namespace, block_id)
        words = self._cache.get(key)
        if words is None:
            rng = random.Random(f"{self.seed}:{namespace}:{block_id}")
            words = tuple(rng.choice(WORDS) for _ in range(self.words_per_block))
            self._cache[key] = words
        return words

    def block(self, block_id: int, namespace: int = 0) -> str:
        return " " + " ".join(self.words(block_id, namespace)) + "."

    def prefix(self, block_id: int, num_words: int, namespace: int = 0) -> str:
        """The first ``num_words`` words of the block (the whole sentence when that is all)."""
        if num_words >= self.words_per_block:
            return self.block(block_id, namespace)
        return " " + " ".join(self.words(block_id, namespace)[: max(1, num_words)])


def trace_text(
    hash_ids: tuple[int, ...], num_tokens: int, block_len: int, texts: TextBlocks
) -> str:
    """The text prompt of a trace row whose token prompt is ``num_tokens`` tokens of
    ``block_len``-token blocks: one sentence per hash id, the last cut to the same share of
    its words as the token prompt's last block; a row without hash ids gets a sentence of its
    own (namespace 1, keyed by its length)."""
    if not hash_ids:
        return texts.block(num_tokens, namespace=1)
    full, rest = divmod(num_tokens, block_len)
    parts = [texts.block(h) for h in hash_ids[:full]]
    if rest and full < len(hash_ids):
        n = round(rest * texts.words_per_block / block_len)
        parts.append(texts.prefix(hash_ids[full], n))
    return "".join(parts).lstrip(" ")
