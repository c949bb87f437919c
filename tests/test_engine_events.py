"""vLLM-format KV events re-keyed into our hash, applied in sequence order (torch-free).

The streams here are built with ``prefixmesh.vllm_events``'s encoder; the contract with a real
vLLM's bytes is tests/test_vllm_fixture.py's. Every check compares the view with what our own
hashing of the engine's cached prompts gives (``block_hashes``), so a wrong re-keying, a lost
event or an event applied out of order fails it.
"""

from __future__ import annotations

import random

import pytest

from prefixmesh import vllm_events as ve
from prefixmesh.hashing import block_hashes
from router.engines.follower import EventFollower
from router.engines.translate import EngineCacheView

MODEL = "smollm2"


class FakeEngine:
    """Plays an engine's prefix cache: full blocks of prompts, hashed by the engine's own ids."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[int, tuple[int, ...]] = {}  # engine hash -> the prompt prefix it ends
        self._ids: dict[tuple[int, ...], int] = {}

    def store(self, prompt: list[int]) -> ve.BlockStored | None:
        bs, hashes, parent, tokens = self.block_size, [], None, []
        for i in range(len(prompt) // bs):
            prefix = tuple(prompt[: (i + 1) * bs])
            h = self._ids.setdefault(prefix, random.getrandbits(63))
            if h in self.blocks:
                parent = h
                continue
            self.blocks[h] = prefix
            hashes.append(h)
            tokens += prefix[-bs:]
        return ve.BlockStored(hashes, parent, tokens, bs) if hashes else None

    def evict(self, n: int, rng: random.Random) -> ve.BlockRemoved:
        # Leaves first, as vLLM evicts: a block whose prefix no other cached block extends.
        leaves = [h for h, p in self.blocks.items()
                  if not any(len(q) > len(p) and q[: len(p)] == p for q in self.blocks.values())]  # fmt: skip
        gone = rng.sample(leaves, min(n, len(leaves)))
        for h in gone:
            del self.blocks[h]
        return ve.BlockRemoved(gone)

    def expected(self, our_block_size: int, blocks: dict | None = None) -> set[bytes]:
        """Our hashes of every cached prefix (now, or in a snapshot of ``blocks``)."""
        out: set[bytes] = set()
        for prefix in (self.blocks if blocks is None else blocks).values():
            out.update(block_hashes(list(prefix), our_block_size, MODEL))
        return out


def _stream(
    engine: FakeEngine, rng: random.Random, steps: int, states: list[dict] | None = None
) -> list[bytes]:
    """``steps`` encoded batches; ``states`` gets the engine's cache after each one."""
    payloads, prompts = [], [[rng.randrange(1, 500) for _ in range(96)] for _ in range(4)]
    for _ in range(steps):
        base = rng.choice(prompts)
        prompt = base[: rng.randrange(0, 96)] + [rng.randrange(1, 500) for _ in range(40)]
        events: list[ve.Event] = []
        if len(engine.blocks) > 20:
            events.append(engine.evict(rng.randrange(1, 6), rng))
        stored = engine.store(prompt)
        if stored is not None:
            events.append(stored)
        payloads.append(ve.encode_batch(ve.EventBatch(0.0, events, 0)))
        if states is not None:
            states.append(dict(engine.blocks))
    return payloads


@pytest.mark.parametrize("engine_bs,our_bs", [(16, 16), (32, 16), (16, 32), (12, 16)])
def test_rekeying_matches_our_hash_in_any_block_size(engine_bs: int, our_bs: int) -> None:
    rng = random.Random(engine_bs * 100 + our_bs)
    engine = FakeEngine(engine_bs)
    follower = EventFollower(EngineCacheView(MODEL, our_bs))
    states: list[dict] = []
    for seq, payload in enumerate(_stream(engine, rng, 60, states)):
        follower.on_message(seq, payload)
        if seq == 0:
            follower.on_replay([])  # nothing before 0: the view starts from here, exact
        assert follower.view.hashes == engine.expected(our_bs, states[seq]), f"after {seq}"
    assert follower.clears == 0 and follower.view.skipped == 0


def test_a_gap_and_a_reordering_end_with_the_view_exact() -> None:
    rng = random.Random(7)
    engine = FakeEngine(32)
    payloads = _stream(engine, rng, 80)
    follower = EventFollower(EngineCacheView(MODEL, 16))
    order = list(range(80))
    order[30], order[31] = order[31], order[30]  # a reordering: 31 arrives before 30
    lost = {50, 51, 52}  # a gap: never delivered live
    for seq in order:
        if seq in lost:
            continue
        follower.on_message(seq, payloads[seq])
        if seq == 0:
            follower.on_replay([])
        if follower.replay_from == 50:  # the subscriber asks the replay socket for 50 on
            follower.on_replay((s, payloads[s]) for s in range(50, seq + 1))
    assert follower.replay_from is None
    assert follower.view.hashes == engine.expected(16)
    assert follower.gaps >= 2 and follower.clears == 0


def test_a_removal_overtaking_its_store_is_not_left_stale() -> None:
    """llm-d's bug: Removed applied before the Stored it follows left a block the engine had
    dropped. Held back until the Stored is applied, the view ends without it."""
    engine = FakeEngine(16)
    prompt = list(range(1, 49))
    stored = engine.store(prompt)
    removed = engine.evict(3, random.Random(0))
    assert stored is not None and len(removed.block_hashes) == 1
    p0 = ve.encode_batch(ve.EventBatch(0.0, [stored]))
    p1 = ve.encode_batch(ve.EventBatch(0.0, [removed]))
    follower = EventFollower(EngineCacheView(MODEL, 16))
    follower.on_replay([])  # a fresh engine: nothing to replay
    follower.next_seq = 0
    follower.on_message(1, p1)  # the removal arrives first
    assert follower.view.hashes == set() and follower.replay_from == 0
    follower.on_message(0, p0)
    assert follower.view.hashes == engine.expected(16)
    assert len(follower.view) == 2


def test_an_unfillable_gap_clears_the_view_and_rebuilds() -> None:
    rng = random.Random(3)
    engine = FakeEngine(16)
    states: list[dict] = []
    payloads = _stream(engine, rng, 40, states)
    follower = EventFollower(EngineCacheView(MODEL, 16))
    for seq in range(20):
        follower.on_message(seq, payloads[seq])
        if seq == 0:
            follower.on_replay([])
    follower.on_message(25, payloads[25])
    delta = follower.on_replay([])  # the engine's replay buffer no longer holds 20..24
    assert delta.cleared and follower.clears == 1 and follower.next_seq == 26
    # Only blocks stored after the clear (with a known parent) are claimed, never stale ones.
    assert follower.view.hashes <= engine.expected(16, states[25])
    for seq in range(26, 40):
        follower.on_message(seq, payloads[seq])
        assert follower.view.hashes <= engine.expected(16, states[seq])
    follower.on_message(40, ve.encode_batch(ve.EventBatch(0.0, [ve.AllBlocksCleared()])))
    assert follower.view.hashes == set()


def test_bad_payloads_raise_a_clear_error() -> None:
    with pytest.raises(ve.EventFormatError, match="EventBatch"):
        ve.decode_batch(b"\x93\x01\x02\x03")
    with pytest.raises(ve.EventFormatError, match="msgpack"):
        ve.decode_batch(b"\xc1")
    with pytest.raises(ve.EventFormatError, match="8 bytes"):
        ve.parse_seq(b"\x00")
