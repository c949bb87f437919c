"""The router tokenizes and hashes a request exactly as a replica does (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_tiny_tokenizer

from prefixmesh.hashing import block_hashes
from prefixmesh.prompt_ids import prompt_token_ids
from prefixmesh.tokenizer import Tokenizer
from proto import prefixmesh_pb2 as pb
from router.discovery import ReplicaView
from router.prompt import tokenize

GROUP = ("tiny-model", 4)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(folder)
    return Tokenizer.from_dir(folder)


def view_with(tokenizer: Tokenizer | None) -> ReplicaView:
    view = ReplicaView()
    view.tokenizers[GROUP] = tokenizer
    view.model_ids[GROUP] = GROUP[0]
    return view


def requests() -> list[pb.GenerateRequest]:
    chat = pb.ChatMessages(messages=[
        pb.ChatMessage(role="system", content="You are a router. Keep prefixes warm."),
        pb.ChatMessage(role="user", content="Which replica holds my cache? café 東京"),
    ])  # fmt: skip
    no_prompt = pb.ChatMessages(messages=chat.messages, add_generation_prompt=False)
    return [
        pb.GenerateRequest(text="the cache prefix token router replica model block hash"),
        pb.GenerateRequest(chat=chat),
        pb.GenerateRequest(chat=no_prompt),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 40)))),
    ]


@pytest.mark.parametrize("index", range(4))
def test_token_ids_and_hashes_match_the_replica(tokenizer: Tokenizer, index: int) -> None:
    request = requests()[index]
    tokens = tokenize(request, view_with(tokenizer))
    # What replica/server/request_mapping.py computes:
    expected = prompt_token_ids(request, tokenizer)
    assert tokens.ids_by_group[GROUP] == expected
    assert tokens.hashes_by_group[GROUP] == block_hashes(expected, 4, GROUP[0])


def test_resume_tokens_and_salt_enter_the_hashes_only(tokenizer: Tokenizer) -> None:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9, 10]), resume_token_ids=[11, 12], cache_salt="t1"
    )
    tokens = tokenize(request, view_with(tokenizer))
    assert tokens.ids_by_group[GROUP] == [5, 6, 7, 8, 9, 10]
    assert tokens.hashes_by_group[GROUP] == block_hashes(list(range(5, 13)), 4, GROUP[0], "t1")


def test_without_a_tokenizer_only_token_ids_are_routable() -> None:
    view = view_with(None)
    assert tokenize(pb.GenerateRequest(text="hello"), view).ids_by_group == {}
    ids = tokenize(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, 4])), view)
    assert ids.hashes_by_group[GROUP] == block_hashes([1, 2, 3, 4], 4, GROUP[0])


def test_token_ids_read_by_the_caller_give_the_same_prompt_and_hashes() -> None:
    """The forwarder reads a request's token ids once and passes them along: the same ids and
    hashes as reading them here, with or without resume tokens and salt; the bounds check on
    them (negative ids) is the same too."""
    from prefixmesh.limits import RequestLimits, check_request

    view = view_with(None)
    for resume, salt in (([], ""), ([7, 8, 9, 10, 11], "tenant-a")):
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=list(range(3, 40))), resume_token_ids=resume, cache_salt=salt
        )
        ids = request.token_ids.ids[:]
        passed, read = tokenize(request, view, ids), tokenize(request, view)
        assert passed.ids_by_group == read.ids_by_group and passed.ids_by_group[GROUP] == ids
        assert passed.hashes_by_group == read.hashes_by_group
        assert passed.hashes_by_group[GROUP] == block_hashes(
            ids + resume, GROUP[1], GROUP[0], salt or None
        )
        check_request(request, RequestLimits(), token_ids=ids)
    bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, -2, 3]))
    for token_ids in (None, bad.token_ids.ids[:]):
        with pytest.raises(ValueError, match=r"token_ids.ids\[1\] must be a token id >= 0"):
            check_request(bad, RequestLimits(), token_ids=token_ids)


def test_block_hash_cache_returns_what_hashing_computes() -> None:
    """Hits and misses alike equal prefixmesh.hashing.block_hashes (model, block size, salt and
    every token of the full blocks are the key; a partial last block is not), and the cache
    stays within its byte bound, oldest out first."""
    import random

    from router.prompt import BlockHashCache

    rng = random.Random(0)
    cache = BlockHashCache(max_bytes=4096)
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(0, 300))] for _ in range(20)]
    for _ in range(400):
        ids = list(rng.choice(prompts))
        if ids and rng.random() < 0.3:
            ids[rng.randrange(len(ids))] += 1  # one token differs
        if rng.random() < 0.3:
            ids += [7] * rng.randrange(1, 4)  # a different partial block
        block_size, model = rng.choice([4, 16]), rng.choice(["m1", "m2"])
        salt = rng.choice([None, "", "tenant"])
        want = block_hashes(ids, block_size, model, salt)
        assert cache.block_hashes(ids, block_size, model, salt) == want
        assert cache.block_hashes(ids, block_size, model, salt) == want  # now a hit
        assert cache.bytes <= cache.max_bytes
    assert cache.bytes == sum(len(key[3]) for key in cache._entries)


def test_block_hash_cache_reuses_power_of_two_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts sharing a prefix with an earlier one (a longer suffix, another suffix, the same
    prompt again, another tenant's) hash only the blocks past the longest cached power-of-two
    prefix, and every answer equals a fresh prefixmesh.hashing.block_hashes."""
    import random

    import router.prompt as prompt

    hashed: list[int] = []

    def counting(data: bytes, block_size: int, *args: object) -> list[bytes]:
        hashed.append(len(data) // (4 * block_size))
        return prompt_hashes(data, block_size, *args)  # type: ignore[arg-type]

    prompt_hashes = prompt.packed_block_hashes
    monkeypatch.setattr(prompt, "packed_block_hashes", counting)
    rng = random.Random(1)
    cache = prompt.BlockHashCache()
    shared = [rng.randrange(50_000) for _ in range(512)]

    def hashes(ids: list[int], salt: str | None = None) -> int:
        hashed.clear()
        assert cache.block_hashes(ids, 4, "m", salt) == block_hashes(ids, 4, "m", salt)
        return sum(hashed)

    assert hashes(shared + [1] * 8) == 130  # cold: every block
    assert hashes(shared + [2] * 8) == 2  # 128 blocks cached (a power of two)
    assert hashes(shared + [2] * 8) == 2  # the same prompt again: still past 128
    assert hashes(shared[:300]) == 75 - 64  # a shorter prompt: its 64-block prefix
    assert hashes(shared + [3] * 500) == 253 - 128  # a conversation's next turn
    assert hashes(shared + [3] * 500 + [4] * 40) == 263 - 128  # and the next: still 128
    assert hashes(shared + [2] * 8, "tenant") == 130  # another salt shares nothing
    assert hashes(shared[:3]) == 0  # no full block
    for _ in range(300):  # random prefixes, suffixes and edits against fresh hashes
        ids = shared[: rng.randrange(0, 600)] + [rng.randrange(9) for _ in range(rng.randrange(9))]
        if ids and rng.random() < 0.2:
            ids[rng.randrange(len(ids))] += 1
        hashes(ids, rng.choice([None, "", "t"]))
