"""KV blocks moved between two engines (no network): pinning, the salt's chain, insertion under
unchanged hashes, and greedy output after a transfer identical to a cold run."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import blocks_held_by

from prefixmesh.hashing import block_hashes
from replica import LLM, SamplingParams
from replica.engine_request import EngineRequest

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
BS = 16


def make_llm(model_dir, dtype: str = "float32", num_kv_blocks: int = 64) -> LLM:
    return LLM(str(model_dir), dtype=dtype, num_kv_blocks=num_kv_blocks, block_size=BS)


def prompt(n: int = 100, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 400) for _ in range(n)]


def transfer(src: LLM, dst: LLM, ids: list[int], salt: str | None = None) -> int:
    """Copy the blocks of ``ids`` that ``src`` holds into ``dst`` (as the servers do)."""
    return dst.engine.import_blocks(blocks_held_by(src.engine, dst.engine, ids, salt))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fetched_prefix_gives_the_cold_output(tiny_model_dir, dtype):
    src, dst, cold = (make_llm(tiny_model_dir, dtype) for _ in range(3))
    ids = prompt(100)
    src.generate([ids], GREEDY)
    stored: list[bytes] = []
    dst.engine.set_kv_event_callback(lambda added, removed: stored.extend(added))
    assert transfer(src, dst, ids + [7, 8, 9]) == 6  # 100 tokens: 6 full blocks
    expected = block_hashes(ids, BS, dst.engine.model_id)
    assert stored == expected  # announced under the peer's hashes, unchanged
    assert dst.engine.cached_block_hashes() == set(expected)
    fetched = dst.generate([ids + [7, 8, 9]], GREEDY)[0]
    cold_out = cold.generate([ids + [7, 8, 9]], GREEDY)[0]
    assert fetched.num_cached_tokens == 96
    assert cold_out.num_cached_tokens == 0
    assert fetched.token_ids == cold_out.token_ids
    for llm in (src, dst, cold):
        llm.engine.check_integrity()
        assert llm.engine.get_stats().free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("src_keys", "dst_keys"), [("rows", "tokens"), ("tokens", "rows"), ("heads", "tokens")]
)
def test_blocks_move_between_replicas_that_store_keys_differently(
    tiny_model_dir, monkeypatch, src_keys, dst_keys
):
    # An AMX replica keeps bfloat16 keys in rows, others token-minor (kernels.interface): the
    # wire format is the logical [block_size, kv_heads, head_dim], whatever either side stores.
    monkeypatch.setenv("PREFIXMESH_KEY_LAYOUT", src_keys)
    src = make_llm(tiny_model_dir)
    monkeypatch.setenv("PREFIXMESH_KEY_LAYOUT", dst_keys)
    dst, cold = make_llm(tiny_model_dir), make_llm(tiny_model_dir)
    if src.engine.runner.key_layout == dst.engine.runner.key_layout:
        pytest.skip("no C++ kernels here: both replicas keep keys in rows")
    ids = prompt(100, seed=5)
    src.generate([ids], GREEDY)
    assert transfer(src, dst, ids + [7, 8, 9]) == 6
    fetched = dst.generate([ids + [7, 8, 9]], GREEDY)[0]
    assert fetched.num_cached_tokens == 96
    assert fetched.token_ids == cold.generate([ids + [7, 8, 9]], GREEDY)[0].token_ids
    for llm in (src, dst, cold):
        llm.engine.check_integrity()


def test_pinned_blocks_survive_eviction_and_are_released(tiny_model_dir):
    src = make_llm(tiny_model_dir, num_kv_blocks=12)
    ids = prompt(100)
    src.generate([ids], GREEDY)
    hashes = block_hashes(ids, BS, src.engine.model_id)
    pinned = src.engine.pin_prefix(hashes, None)
    assert len(pinned.blocks) == 6
    assert src.engine.num_pinned_blocks == 6
    src.engine.check_integrity()  # pins count as references
    before = [src.engine.runner.kv_caches[0][0][b].clone() for b in pinned.blocks]
    # Another prompt needs more blocks than are free: only unpinned ones may be evicted.
    src.generate([prompt(90, seed=1)], SamplingParams(temperature=0, max_tokens=4))
    assert set(hashes) <= src.engine.cached_block_hashes()
    for b, old in zip(pinned.blocks, before):
        assert torch.equal(src.engine.runner.kv_caches[0][0][b], old)
    src.engine.unpin(pinned.pin_id)
    src.engine.unpin(pinned.pin_id)  # twice is harmless
    assert src.engine.num_pinned_blocks == 0
    src.engine.check_integrity()
    assert src.engine.get_stats().free_blocks == 12


def test_another_salts_blocks_are_not_served(tiny_model_dir):
    src = make_llm(tiny_model_dir)
    ids = prompt(100)
    src.engine.add(EngineRequest("a", ids, GREEDY, cache_salt="tenant-a"))
    while src.engine.has_unfinished_requests():
        src.engine.step()
    salted = block_hashes(ids, BS, src.engine.model_id, "tenant-a")
    # The right hashes but the wrong salt (or none): the tokens do not chain to them.
    for salt in (None, "tenant-b"):
        pinned = src.engine.pin_prefix(salted, salt)
        assert pinned.blocks == []
        src.engine.unpin(pinned.pin_id)
    assert len(src.engine.pin_prefix(block_hashes(ids, BS, src.engine.model_id), None).blocks) == 0
    pinned = src.engine.pin_prefix(salted, "tenant-a")
    assert len(pinned.blocks) == 6
    src.engine.unpin(pinned.pin_id)
    pinned = src.engine.pin_prefix(salted, "tenant-a", start=4)
    assert pinned.hashes == salted[4:6]
    src.engine.unpin(pinned.pin_id)
    for p in list(src.engine._pins):
        src.engine.unpin(p)
    src.engine.check_integrity()
    assert src.engine.num_pinned_blocks == 0


def test_import_into_a_full_pool_keeps_what_fits(tiny_model_dir):
    src = make_llm(tiny_model_dir)
    dst = make_llm(tiny_model_dir, num_kv_blocks=4)
    ids = prompt(100)
    src.generate([ids], GREEDY)
    assert transfer(src, dst, ids) == 4  # 6 offered, the pool has 4
    dst.engine.check_integrity()
    out = dst.generate([ids[:40]], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.num_cached_tokens == 32
    dst.engine.check_integrity()
