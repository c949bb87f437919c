"""Wire <-> engine: a ``GenerateRequest`` becomes an ``EngineRequest``, a ``StepOutput`` a response.

Validation errors are ``ValueError``s naming the field as the client spells it; the servicer
turns them into ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixmesh.limits import check_context
from prefixmesh.prompt_ids import prompt_token_ids
from prefixmesh.stop_strings import unsent_text
from prefixmesh.tokenizer import Tokenizer
from proto import prefixmesh_pb2 as pb
from replica.detokenizer import resumed_text
from replica.engine_request import EngineRequest
from replica.outputs import StepOutput
from replica.sampling_params import SamplingParams

# Proto optional fields that map one to one onto SamplingParams (unset = the engine default).
_OPTIONAL_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs",
    "min_tokens", "skip_special_tokens",
)  # fmt: skip


@dataclass(slots=True)
class MappedRequest:
    """One ``GenerateRequest``: the ``EngineRequest`` it becomes, and what its responses need."""

    engine: EngineRequest  # its prompt: token ids, the resumed tokens appended
    num_resumed: int  # tokens an earlier replica generated, appended to the prompt
    num_fetched_tokens: int = 0  # leading prompt tokens whose KV came from a peer replica

    @property
    def prompt_token_ids(self) -> list[int]:
        ids = self.engine.prompt
        assert isinstance(ids, list)  # the mapping always tokenizes
        return ids

    @property
    def num_prompt_tokens(self) -> int:
        """The client's prompt, without the resumed tokens."""
        return len(self.prompt_token_ids) - self.num_resumed


def sampling_params(sp: pb.SamplingParams) -> SamplingParams:
    """Proto -> engine sampling parameters; raises ``ValueError`` naming the bad field."""
    kwargs: dict[str, Any] = {f: getattr(sp, f) for f in _OPTIONAL_FIELDS if sp.HasField(f)}
    return SamplingParams(
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        **kwargs,
    )


def context_budget(
    sp: pb.SamplingParams, params: SamplingParams, num_prompt_tokens: int, max_model_len: int
) -> int:
    """The output budget, whole (resumed tokens included, so before they are subtracted): with
    ``fit_context`` ``max_tokens`` shrinks to the room the prompt leaves; a ``max_tokens`` the
    client set must fit (``check_context``); the default is left to stop at the context."""
    if sp.fit_context:
        room = max_model_len - num_prompt_tokens
        if room < 1:
            check_context(num_prompt_tokens, params.max_tokens, max_model_len)  # names it
        return min(params.max_tokens, room)
    if sp.HasField("max_tokens"):
        check_context(num_prompt_tokens, params.max_tokens, max_model_len)
    return params.max_tokens


def _check_ids(name: str, ids: list[int], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{i}] must be a token id in [0, {vocab_size}) (got {t})")


def engine_request(
    request: pb.GenerateRequest,
    tokenizer: Tokenizer,
    vocab_size: int,
    *,
    request_id: str = "",
    arrival_time: float | None = None,
    max_model_len: int | None = None,
) -> MappedRequest:
    """Validate and convert a request; ``ValueError`` names the first bad field.

    ``request_id`` is the engine's id for it (unique in the engine; the client's may collide).
    With ``max_model_len`` (a server's), the output budget is settled against the context.
    """
    params = sampling_params(request.sampling)
    ids = prompt_token_ids(request, tokenizer)
    if request.WhichOneof("input") == "token_ids":
        _check_ids("token_ids.ids", ids, vocab_size)
    if max_model_len is not None:
        params.max_tokens = context_budget(request.sampling, params, len(ids), max_model_len)
    resumed = list(request.resume_token_ids)
    _check_ids("resume_token_ids", resumed, vocab_size)
    if resumed:
        if params.n != 1:
            raise ValueError(f"resume_token_ids needs n == 1 (got n={params.n})")
        if len(resumed) >= params.max_tokens:
            raise ValueError(
                f"resume_token_ids has {len(resumed)} tokens, must be fewer than "
                f"max_tokens={params.max_tokens}"
            )
        # The resumed tokens count toward the budget: continue for what is left of it.
        params.max_tokens -= len(resumed)
        params.min_tokens = max(0, params.min_tokens - len(resumed))
    unsent = ""
    if request.HasField("resume_text_chars"):
        text = resumed_text(tokenizer, ids, resumed, params.skip_special_tokens) if resumed else ""
        unsent = unsent_text(
            text, request.resume_text_chars, params.stop, params.include_stop_str_in_output,
            matching=params.min_tokens == 0,
        )  # fmt: skip
    engine = EngineRequest(
        request_id=request_id,
        prompt=ids + resumed,
        params=params,
        priority=request.priority,
        cache_salt=request.cache_salt,
        arrival_time=arrival_time,
        unsent_text=unsent,
    )
    return MappedRequest(engine, num_resumed=len(resumed))


def response(
    out: StepOutput, request_id: str, replica_id: str, req: MappedRequest
) -> pb.GenerateResponse:
    """One streamed message; the last one of a sample carries finish reason and usage."""
    msg = pb.GenerateResponse(
        request_id=request_id,
        index=out.index,
        token_ids=out.new_token_ids,
        text=out.new_text,
        replica_id=replica_id,
    )
    for lp in out.new_logprobs or ():
        msg.logprobs.append(pb.Logprobs(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
        ))  # fmt: skip
    if out.finished:
        msg.finish_reason = out.finish_reason or ""
        msg.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
        # Usage as if the request had run here from the start: the resumed tokens are output,
        # not prompt, so a router's totals stay the same whether or not it failed over.
        prompt = req.num_prompt_tokens
        msg.usage.prompt_tokens = prompt
        msg.usage.completion_tokens = out.num_output_tokens + req.num_resumed
        msg.usage.cached_tokens = min(out.num_cached_tokens, prompt)
        msg.usage.fetched_tokens = min(req.num_fetched_tokens, msg.usage.cached_tokens)
    return msg
