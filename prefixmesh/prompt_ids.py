"""A ``GenerateRequest``'s prompt as token ids: the one tokenization router, replica and the
echo test double share, so a router hashes exactly the blocks a replica will cache.

Torch-free. Errors are ``ValueError``s naming the field as the client spells it (a replica
turns them into ``INVALID_ARGUMENT``; a router skips the group and lets the replica say so).
"""

from __future__ import annotations

from prefixmesh.tokenizer import Tokenizer
from proto import prefixmesh_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _chat_messages(chat: pb.ChatMessages) -> list[dict[str, str]]:
    """The chat's messages as the template takes them; raises on an empty chat or a bad role."""
    if not chat.messages:
        raise ValueError("chat.messages must not be empty")
    messages = []
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise ValueError(
                f"chat.messages[{i}].role must be one of {', '.join(CHAT_ROLES)} "
                f"(got {message.role!r})"
            )
        messages.append({"role": message.role, "content": message.content})
    return messages


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: Tokenizer | None) -> list[int]:
    """The prompt as token ids, tokenized exactly as the engine would tokenize it.

    ``tokenizer`` may be None only for ``token_ids`` input (a text or chat prompt then raises).
    """
    kind = request.WhichOneof("input")
    if kind is None:
        raise ValueError("input is required: set one of text, token_ids or chat")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise ValueError("token_ids.ids must not be empty")
        return ids
    if tokenizer is None:
        raise ValueError(f"{kind} input needs the model's tokenizer here: send token_ids")
    if kind == "text":
        if not request.text:
            raise ValueError("text must not be empty")
        return tokenizer.encode(request.text)
    chat = request.chat
    add_generation_prompt = (
        chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    )
    return tokenizer.encode_chat(_chat_messages(chat), add_generation_prompt=add_generation_prompt)
