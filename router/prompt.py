"""A request's prompt as the replicas see it: token ids and chained block hashes.

Text is encoded with ``Tokenizer.encode`` and chat with ``Tokenizer.encode_chat``, exactly as
``replica/server/request_mapping.py`` does, using the tokenizer files each model's replicas publish
(``Replica.GetModelInfo``); token ids are taken as they are. Hashes come from
``prefixmesh/hashing.py`` only, over prompt + ``resume_token_ids``.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from prefixmesh.hashing import BlockHash, packed_block_hashes, token_bytes
from prefixmesh.prompt_ids import prompt_token_ids
from proto import prefixmesh_pb2 as pb
from router.discovery import GROUP_KEY, ReplicaView


class BlockHashCache:
    """Block hashes of recent prompts' leading 1, 2, 4, 8, ... blocks, by model, block size,
    salt and the exact tokens of those blocks. A prompt seen again, whole or with another or
    longer suffix (a request retried or resumed, a conversation's next turn, prompts sharing a
    system prompt or document), takes the hashes of its longest cached power-of-two prefix
    (more than half of what it shares with the earlier prompt) and hashes only the blocks after
    it. Least recently used first out, bounded by the bytes of the packed tokens it keeps (the
    hashes take about as much again). The lists it returns are shared: never modify them."""

    def __init__(self, max_bytes: int = 8 * 2**20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str, int, bytes], list[BlockHash]] = OrderedDict()

    def block_hashes(
        self,
        token_ids: list[int],
        block_size: int,
        model_id: str,
        cache_salt: str = "",
        packed: bytes | None = None,
    ) -> list[BlockHash]:
        """``prefixmesh.hashing.block_hashes`` of the tokens, from the cache when it can.
        ``packed``: ``token_bytes(token_ids)``, if the caller has it."""
        num = len(token_ids) // block_size
        if num == 0:
            return []
        step = 4 * block_size
        data = token_bytes(token_ids[: num * block_size]) if packed is None else packed
        entries = self._entries
        head: list[BlockHash] = []
        known = 1 << (num.bit_length() - 1)  # the longest power-of-two prefix, then shorter
        while known:
            key = (model_id, cache_salt, block_size, data[: known * step])
            found = entries.get(key)
            if found is not None:
                entries.move_to_end(key)
                head = found
                break
            known >>= 1
        if known == num:
            return head
        rest = packed_block_hashes(
            data[known * step : num * step], block_size, model_id, cache_salt,
            head[-1] if head else None,
        )  # fmt: skip
        hashes = head + rest
        blocks = known * 2 or 1
        while blocks <= num and blocks * step <= self.max_bytes:
            entries[(model_id, cache_salt, block_size, data[: blocks * step])] = hashes[:blocks]
            self.bytes += blocks * step
            blocks *= 2
        while self.bytes > self.max_bytes:
            old, _ = entries.popitem(last=False)
            self.bytes -= len(old[3])
        return hashes


_HASHES = BlockHashCache()


@dataclass(slots=True)
class PromptTokens:
    """Per (model, block size) group: the prompt's token ids and its block hashes."""

    ids_by_group: dict[GROUP_KEY, list[int]] = field(default_factory=dict)
    hashes_by_group: dict[GROUP_KEY, list[BlockHash]] = field(default_factory=dict)


def tokenize(
    request: pb.GenerateRequest,
    view: ReplicaView,
    token_ids: list[int] | None = None,
    packed: bytes | None = None,
) -> PromptTokens:
    """Prompt token ids (as replicas compute them) and the block hashes of prompt + resume
    tokens, per model group. ``token_ids``: the request's ``token_ids.ids`` already read into
    a list, if the caller has it (shared by every group, never modified); ``packed``: those
    ids as ``prefixmesh.hashing.token_bytes`` packs them, if the caller has that too."""
    out = PromptTokens()
    kind = request.WhichOneof("input")
    for group in set(view.tokenizers) | set(view.model_ids):
        tokenizer = view.tokenizers.get(group)
        if kind == "token_ids":  # taken as they are, even empty: the replica says what is wrong
            ids = request.token_ids.ids[:] if token_ids is None else token_ids
        else:
            try:
                ids = prompt_token_ids(request, tokenizer)
            except ValueError:
                continue  # the replica will reject it with a precise INVALID_ARGUMENT
        out.ids_by_group[group] = ids
    resume = request.resume_token_ids[:]
    if resume or kind != "token_ids" or token_ids is None:
        packed = None  # the caller's packing is of the token_ids list alone
    for group, ids in out.ids_by_group.items():
        model_id = view.model_ids.get(group)
        if model_id is not None:
            out.hashes_by_group[group] = _HASHES.block_hashes(
                ids + resume if resume else ids, group[1], model_id, request.cache_salt,
                packed,
            )  # fmt: skip
    return out


def fallback_affinity(ids: list[int] | None, request_id: str) -> bytes:
    """Tie-break key without a full block: the tokens, else the request id (spreads evenly)."""
    if ids:
        return xxhash.xxh3_128_digest(repr(ids).encode())
    return (request_id or uuid.uuid4().hex).encode()
