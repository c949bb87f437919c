"""Request limits shared by replicas and routers: bounded requests, clean statuses. Torch-free.

Every field of ``GenerateRequest`` that a client can make arbitrarily large or extreme has a
bound here, so a hostile or buggy client gets ``INVALID_ARGUMENT`` naming the field and the
bound at once, instead of holding the engine (``n = 100000``), slowing every step (10,000 stop
strings) or bloating Redis keys (a 1 MB ``cache_salt``). The bounds are flags of the replica
and of the router (``--max-n``, ...; ``RequestLimits.from_config`` reads them), so both ends
answer the same. ``check_context`` is the OpenAI / vLLM rule that prompt + ``max_tokens`` must
fit the context; it runs on the replica, which knows the model's ``max_model_len``.

Overload (a full queue, a tenant over its share, every replica busy) is ``RESOURCE_EXHAUSTED``
with a retry-after hint: trailing metadata ``retry-after`` (seconds, as HTTP's header) and
``grpc-retry-pushback-ms`` (what gRPC's own retry policy reads); the HTTP front door turns it
into 429 with a ``Retry-After`` header.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from proto import prefixmesh_pb2 as pb

RETRY_AFTER_KEY = "retry-after"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds one server enforces (defaults: far above any sane client's needs)."""

    max_n: int = 16
    max_stop: int = 16
    max_stop_len: int = 256
    max_id_len: int = 256  # request_id and cache_salt
    max_priority: int = 1_000_000  # priority must lie in [-max_priority, max_priority]
    max_message_bytes: int = 4 * 2**20  # one gRPC message or one HTTP body
    retry_after_s: float = 1.0  # the hint sent with RESOURCE_EXHAUSTED / 429

    @classmethod
    def from_config(cls, config: Any) -> RequestLimits:
        """The limits of a ``ServerConfig`` or ``RouterConfig`` (same field names)."""
        defaults = cls()
        return cls(**{f: getattr(config, f, getattr(defaults, f)) for f in cls.__slots__})

    def grpc_options(self) -> list[tuple[str, int]]:
        """Server options: messages beyond ``max_message_bytes`` get RESOURCE_EXHAUSTED from
        gRPC itself, before any of our code runs."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", max(self.max_message_bytes, 64 * 2**20)),
        ]


# Flag help, merged into the replica's and the router's own help tables.
HELP: dict[str, str] = {
    "max_n": "most parallel samples (SamplingParams.n) one request may ask for",
    "max_stop": "most stop strings per request",
    "max_stop_len": "longest stop string, in characters",
    "max_id_len": "longest request_id and cache_salt, in characters",
    "max_priority": "priority must lie in [-max-priority, max-priority]",
    "max_message_bytes": "largest gRPC request message and HTTP body, in bytes (beyond it: "
    "RESOURCE_EXHAUSTED / 413)",
    "retry_after_s": "seconds sent as the retry-after hint with RESOURCE_EXHAUSTED (HTTP 429 "
    "Retry-After)",
}


def check_limits(limits: RequestLimits) -> list[str]:
    """Problems with the flags themselves (for the config's own check)."""
    problems = []
    for name in ("max_n", "max_stop", "max_stop_len", "max_id_len", "max_message_bytes"):
        if getattr(limits, name) < 1:
            problems.append(
                f"--{name.replace('_', '-')} must be >= 1 (got {getattr(limits, name)})"
            )
    if limits.max_priority < 0:
        problems.append(f"--max-priority must be >= 0 (got {limits.max_priority})")
    if limits.retry_after_s < 0:
        problems.append(f"--retry-after-s must be >= 0 (got {limits.retry_after_s})")
    return problems


def check_request(
    request: pb.GenerateRequest,
    limits: RequestLimits,
    token_ids: Sequence[int] | None = None,
    prompt_ids_checked: bool = False,
) -> None:
    """Raise ``ValueError`` naming the first field beyond ``limits`` (shape only: the value
    ranges of sampling fields are the engine's ``SamplingParams.validate``).

    ``token_ids``: ``request.token_ids.ids`` already read into a list, if the caller has it
    (every read of a repeated field builds its elements again). ``prompt_ids_checked``: the
    caller already knows those ids are >= 0 (the router packs them as unsigned 32-bit for the
    block hashes, which refuses a negative one): they are not scanned again."""
    if len(request.request_id) > limits.max_id_len:
        raise ValueError(
            f"request_id must be at most {limits.max_id_len} characters "
            f"(got {len(request.request_id)})"
        )
    if len(request.cache_salt) > limits.max_id_len:
        raise ValueError(
            f"cache_salt must be at most {limits.max_id_len} characters "
            f"(got {len(request.cache_salt)})"
        )
    if abs(request.priority) > limits.max_priority:
        raise ValueError(
            f"priority must be in [-{limits.max_priority}, {limits.max_priority}] "
            f"(got {request.priority})"
        )
    sp = request.sampling
    if sp.HasField("n") and sp.n > limits.max_n:
        raise ValueError(f"n must be at most {limits.max_n} (got {sp.n})")
    if len(sp.stop) > limits.max_stop:
        raise ValueError(f"stop must hold at most {limits.max_stop} strings (got {len(sp.stop)})")
    for i, stop in enumerate(sp.stop):
        if len(stop) > limits.max_stop_len:
            raise ValueError(
                f"stop[{i}] must be at most {limits.max_stop_len} characters (got {len(stop)})"
            )
    prompt = () if prompt_ids_checked else request.token_ids.ids if token_ids is None else token_ids
    for name, ids in (("token_ids.ids", prompt),
                      ("resume_token_ids", request.resume_token_ids)):  # fmt: skip
        # Negative ids are never tokens; the router hashes them before any replica sees them.
        if ids and min(ids) < 0:
            i = next(i for i, t in enumerate(ids) if t < 0)
            raise ValueError(f"{name}[{i}] must be a token id >= 0 (got {ids[i]})")
    if request.HasField("resume_text_chars") and request.resume_text_chars < 0:
        raise ValueError(f"resume_text_chars must be >= 0 (got {request.resume_text_chars})")


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """OpenAI's and vLLM's rule: prompt + max_tokens must fit the context; the error names
    both numbers (and the most the client may ask for)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        room = max_model_len - num_prompt_tokens
        raise ValueError(
            f"max_tokens={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds the "
            f"context of {max_model_len} tokens (max_model_len): "
            + (f"ask for at most {room} tokens" if room > 0 else "shorten the prompt")
        )


def retry_metadata(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of a RESOURCE_EXHAUSTED answer: when to try again."""
    seconds = max(0, math.ceil(retry_after_s))
    return (
        (RETRY_AFTER_KEY, str(seconds)),
        (RETRY_PUSHBACK_KEY, str(int(retry_after_s * 1000))),
    )


async def abort_busy(context: grpc.aio.ServicerContext, message: str, retry_after_s: float) -> None:
    """Answer RESOURCE_EXHAUSTED with the retry-after hint (never returns)."""
    context.set_trailing_metadata(retry_metadata(retry_after_s))
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}; retry after {retry_after_s:g}s"
    )


def retry_after(metadata: Any) -> str | None:
    """The ``retry-after`` value of a call's trailing metadata, if any."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            return value if isinstance(value, str) else value.decode()
    return None
