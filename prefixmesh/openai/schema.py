"""OpenAI request bodies -> ``GenerateRequest`` protos. Torch-free.

Only shape and type are checked here; value ranges (temperature >= 0, logprobs <= 20, prompt
length ...) are the engine's to judge, so HTTP and gRPC clients get the same answers. Unknown
fields are ignored; known OpenAI fields the engine cannot honour (``echo``, ``suffix``,
penalties, ``tools`` ...) are refused with a 400 rather than silently dropped.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from prefixmesh.request_defaults import requested_n
from proto import prefixmesh_pb2 as pb

# Chat requests without max_tokens: OpenAI means "until the context is full". Sent with
# fit_context, so the replica lowers it to the room left; it also bounds the router's load
# estimate.
CHAT_DEFAULT_MAX_TOKENS = 1024


class OpenAIError(Exception):
    """An error answered in OpenAI's format: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers: dict[str, str] = {}  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass(slots=True)
class ParsedRequest:
    """One HTTP request as upstream calls: one ``GenerateRequest`` per prompt."""

    kind: str  # "completion" or "chat"
    id: str
    model: str | None
    requests: list[pb.GenerateRequest]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-k asked for (chat: top_logprobs), None = no logprobs


# -- typed field readers ------------------------------------------------------------------


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python; JSON true is never a valid number here.
    if isinstance(value, bool) and bool not in kinds:
        raise bad(name, f"'{name}' must be {what} (got {value!r})")
    if not isinstance(value, kinds):
        raise bad(name, f"'{name}' must be {what} (got {value!r})")
    return value


def _int(body: dict[str, Any], name: str) -> int | None:
    value = _get(body, name, (int, float), "an integer")
    if value is not None and value != int(value):
        raise bad(name, f"'{name}' must be an integer (got {value!r})")
    return None if value is None else int(value)


def _float(body: dict[str, Any], name: str) -> float | None:
    value = _get(body, name, (int, float), "a number")
    return None if value is None else float(value)


def _bool(body: dict[str, Any], name: str) -> bool | None:
    return _get(body, name, (bool,), "a boolean")


def _str(body: dict[str, Any], name: str) -> str | None:
    return _get(body, name, (str,), "a string")


def _set_int(sp: pb.SamplingParams, attr: str, value: int | None, param: str) -> None:
    if value is None:
        return
    try:
        setattr(sp, attr, value)
    except ValueError as exc:
        raise bad(param, f"'{param}' is out of range ({value})") from exc


# -- shared sampling fields ---------------------------------------------------------------


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        value = _float(body, name)
        if value:
            raise bad(name, f"'{name}' is not supported by this engine (only 0)")
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise bad("repetition_penalty", "'repetition_penalty' is not supported (only 1)")
    if body.get("logit_bias"):
        raise bad("logit_bias", "'logit_bias' is not supported")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != (_int(body, "n") or 1):
        raise bad("best_of", "'best_of' is not supported (only best_of == n)")
    if body.get("use_beam_search"):
        raise bad("use_beam_search", "beam search is not supported")


def sampling_params(body: dict[str, Any], default_max_tokens: int | None) -> pb.SamplingParams:
    """The fields both endpoints share, vLLM's extra fields included."""
    _refuse_unsupported(body)
    sp = pb.SamplingParams()
    max_tokens = _int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    if max_tokens is None and default_max_tokens is not None:
        # OpenAI's "until the context is full": the replica, which knows max_model_len,
        # settles the default down to the room the prompt leaves (no error, no retry).
        max_tokens, sp.fit_context = default_max_tokens, True
    _set_int(sp, "max_tokens", max_tokens, "max_tokens")
    for name in ("temperature", "top_p", "min_p"):
        value = _float(body, name)
        if value is not None:
            setattr(sp, name, value)
    _set_int(sp, "top_k", _int(body, "top_k"), "top_k")
    _set_int(sp, "seed", _int(body, "seed"), "seed")
    _set_int(sp, "n", _int(body, "n"), "n")
    _set_int(sp, "min_tokens", _int(body, "min_tokens"), "min_tokens")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop", "'stop' must be a string or a list of strings")
        sp.stop.extend(stop)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
            raise bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
        sp.stop_token_ids.extend(stop_ids)
    sp.ignore_eos = bool(_bool(body, "ignore_eos"))
    sp.include_stop_str_in_output = bool(_bool(body, "include_stop_str_in_output"))
    skip = _bool(body, "skip_special_tokens")
    if skip is not None:
        sp.skip_special_tokens = skip
    return sp


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _common(body: dict[str, Any], request: pb.GenerateRequest) -> None:
    request.priority = _int(body, "priority") or 0
    salt = _str(body, "cache_salt")
    if salt:
        request.cache_salt = salt


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    return stream, bool(options.get("include_usage"))


# -- endpoints ----------------------------------------------------------------------------


def _prompts(body: dict[str, Any]) -> list[pb.GenerateRequest]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "'prompt' is required")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad("prompt", "'prompt' must be a string, a list of strings or token ids")
    requests = []
    for item in items:
        if isinstance(item, str):
            requests.append(pb.GenerateRequest(text=item))
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            try:
                requests.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=item)))
            except ValueError as exc:
                raise bad("prompt", "token ids must be 32-bit integers") from exc
        else:
            raise bad("prompt", "each prompt must be a non-empty string or list of token ids")
    return requests


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    """``POST /v1/completions``."""
    if body.get("echo"):
        raise bad("echo", "'echo' is not supported")
    if body.get("suffix"):
        raise bad("suffix", "'suffix' is not supported")
    requests = _prompts(body)
    sp = sampling_params(body, None)
    logprobs = _int(body, "logprobs")
    _set_int(sp, "logprobs", logprobs, "logprobs")
    return _finish("completion", body, requests, sp, logprobs)


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad(f"messages[{i}].content", "content must be a string or a list of text parts")


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    """``POST /v1/chat/completions``: the whole conversation goes upstream as ``chat``, so the
    router hashes the templated conversation and multi-turn chats stick to one replica."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list")
    if body.get("tools"):
        raise bad("tools", "'tools' is not supported")
    chat = pb.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}]", "each message must be an object with a 'role'")
        chat.messages.append(pb.ChatMessage(role=message["role"], content=_content(message, i)))
    add_prompt = _bool(body, "add_generation_prompt")
    if _bool(body, "continue_final_message"):
        add_prompt = False
    if add_prompt is not None:
        chat.add_generation_prompt = add_prompt
    sp = sampling_params(body, CHAT_DEFAULT_MAX_TOKENS)
    logprobs: int | None = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs") or 0
        _set_int(sp, "logprobs", logprobs, "top_logprobs")
    return _finish("chat", body, [pb.GenerateRequest(chat=chat)], sp, logprobs)


def _finish(
    kind: str,
    body: dict[str, Any],
    requests: list[pb.GenerateRequest],
    sp: pb.SamplingParams,
    logprobs: int | None,
) -> ParsedRequest:
    stream, include_usage = _stream_options(body)
    request_id = uuid.uuid4().hex
    for i, request in enumerate(requests):
        request.request_id = request_id if len(requests) == 1 else f"{request_id}-{i}"
        request.sampling.CopyFrom(sp)
        _common(body, request)
    model = body.get("model")
    return ParsedRequest(
        kind=kind,
        id=("chatcmpl-" if kind == "chat" else "cmpl-") + request_id,
        model=model if isinstance(model, str) else None,
        requests=requests,
        n=requested_n(sp),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
    )
