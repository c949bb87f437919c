"""A request's prompt as the replicas see it: token ids and chained block hashes.

Text is encoded with ``Tokenizer.encode`` and chat with ``Tokenizer.encode_chat``, exactly as
``replica/server/request_mapping.py`` does, using the tokenizer files each model's replicas publish
(``Replica.GetModelInfo``); token ids are taken as they are. Hashes come from
``prefixmesh/hashing.py`` only, over prompt + ``resume_token_ids``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import xxhash

from prefixmesh.hashing import BlockHash, block_hashes
from proto import prefixmesh_pb2 as pb
from router.discovery import GROUP_KEY, ReplicaView


@dataclass(slots=True)
class PromptTokens:
    """Per (model, block size) group: the prompt's token ids and its block hashes."""

    ids_by_group: dict[GROUP_KEY, list[int]] = field(default_factory=dict)
    hashes_by_group: dict[GROUP_KEY, list[BlockHash]] = field(default_factory=dict)


def tokenize(
    request: pb.GenerateRequest, view: ReplicaView, token_ids: list[int] | None = None
) -> PromptTokens:
    """Prompt token ids (as replicas compute them) and the block hashes of prompt + resume
    tokens, per model group. ``token_ids``: the request's ``token_ids.ids`` already read into
    a list, if the caller has it (shared by every group, never modified)."""
    out = PromptTokens()
    kind = request.WhichOneof("input")
    for group in set(view.tokenizers) | set(view.model_ids):
        tokenizer = view.tokenizers.get(group)
        try:
            if kind == "token_ids":
                ids = request.token_ids.ids[:] if token_ids is None else token_ids
            elif tokenizer is None:
                continue
            elif kind == "text":
                ids = tokenizer.encode(request.text)  # type: ignore[attr-defined]
            elif kind == "chat":
                chat = request.chat
                messages = [{"role": m.role, "content": m.content} for m in chat.messages]
                add_prompt = (
                    chat.add_generation_prompt if chat.HasField("add_generation_prompt")
                    else True
                )  # fmt: skip
                ids = tokenizer.encode_chat(messages, add_generation_prompt=add_prompt)  # type: ignore[attr-defined]
            else:
                continue
        except ValueError:
            continue  # the replica will reject it with a precise INVALID_ARGUMENT
        out.ids_by_group[group] = ids
    resume = request.resume_token_ids[:]
    for group, ids in out.ids_by_group.items():
        model_id = view.model_ids.get(group)
        if model_id is not None:
            out.hashes_by_group[group] = block_hashes(
                ids + resume if resume else ids, group[1], model_id, request.cache_salt or None
            )
    return out


def fallback_affinity(ids: list[int] | None, request_id: str) -> bytes:
    """Tie-break key without a full block: the tokens, else the request id (spreads evenly)."""
    if ids:
        return xxhash.xxh3_128_digest(repr(ids).encode())
    return (request_id or uuid.uuid4().hex).encode()
