"""Turns sampled tokens into streamed deltas: detokenization and stop conditions per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixmesh.stop_strings import StopStringMatcher
from prefixmesh.tokenizer import Tokenizer
from replica.detokenizer import IncrementalDetokenizer
from replica.outputs import StepOutput, TokenLogprobs
from replica.sampler import SamplingRow, make_generator
from replica.sequence import Request, Sequence


@dataclass(slots=True)
class SampleState:
    """Per-sample output state: its detokenizer, stop-string matcher and sampling row."""

    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    row: SamplingRow
    min_tokens_suppress: list[int] = field(default_factory=list)
    unsent: str = ""  # resumed text cleared for output, streamed before the first token's


class OutputProcessor:
    """Applies stop rules in vLLM's order: stop token ids, EOS, stop strings, length limits."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def new_state(self, seq: Sequence) -> SampleState:
        params = seq.request.params
        generator: torch.Generator | None = None
        if params.seed is not None:
            generator = make_generator(params.seed, seq.index)
        suppress = list(params.stop_token_ids)
        if not params.ignore_eos:
            suppress += sorted(self.eos_token_ids)
        stop = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        unsent = seq.request.unsent_text if seq.index == 0 else ""
        if unsent and params.min_tokens == 0:
            # The replica that generated it was matching stop strings already: hold back the
            # tail that may start one, so a stop string across the resume point still stops.
            unsent, _ = stop.feed(unsent)
        return SampleState(
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, seq.token_ids, params.skip_special_tokens
            ),
            stop=stop,
            row=SamplingRow(params, generator, []),
            min_tokens_suppress=suppress,
            unsent=unsent,
        )

    def sampling_row(self, seq: Sequence) -> SamplingRow:
        state: SampleState = seq.state  # type: ignore[assignment]
        below_min = seq.num_output_tokens < seq.request.params.min_tokens
        state.row.suppress_token_ids = state.min_tokens_suppress if below_min else []
        return state.row

    def append_token(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None
    ) -> StepOutput:
        """Append a sampled token; return the delta, marking the sample finished if it stops."""
        state: SampleState = seq.state  # type: ignore[assignment]
        params = seq.request.params
        seq.token_ids.append(token_id)
        new_text = state.detokenizer.add(token_id)
        num_out = seq.num_output_tokens
        reason: str | None = None
        stop_reason: str | int | None = None
        emit = new_text
        if num_out >= params.min_tokens and token_id in params.stop_token_ids:
            reason, stop_reason, emit = "stop", token_id, ""
        elif (
            num_out >= params.min_tokens
            and not params.ignore_eos
            and (token_id in self.eos_token_ids)
        ):
            reason, emit = "stop", ""
        elif num_out >= params.min_tokens and state.stop.stop:
            emit, matched = state.stop.feed(new_text)
            if matched is not None:
                reason, stop_reason = "stop", matched
        if reason is None and (
            num_out >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None and not isinstance(stop_reason, str):
            # Finished other than by a stop string (EOS, a stop token id, length): the text
            # held back for a possible stop-string match is output text after all.
            emit += state.stop.flush()
        if state.unsent:
            emit, state.unsent = state.unsent + emit, ""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        return StepOutput(
            request_id=seq.request.request_id,
            index=seq.index,
            new_token_ids=[token_id],
            new_text=emit,
            finished=reason is not None,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(seq.request.prompt_token_ids),
            num_cached_tokens=max(seq.request.num_cached_tokens, 0),
            num_output_tokens=num_out,
            new_logprobs=[logprobs] if logprobs is not None else None,
        )

    def finish(self, seq: Sequence, reason: str) -> StepOutput:
        """The final delta of a sample stopped from outside (abort)."""
        state: SampleState = seq.state  # type: ignore[assignment]
        seq.finish_reason = reason
        unsent, state.unsent = state.unsent, ""
        return StepOutput(
            request_id=seq.request.request_id,
            index=seq.index,
            new_token_ids=[],
            new_text=unsent + state.stop.flush(),
            finished=True,
            finish_reason=reason,
            stop_reason=None,
            num_prompt_tokens=len(seq.request.prompt_token_ids),
            num_cached_tokens=max(seq.request.num_cached_tokens, 0),
            num_output_tokens=seq.num_output_tokens,
        )

    def abort_unstarted(self, request: Request, index: int) -> StepOutput:
        """The final delta of a sample that was never forked (aborted during prefill)."""
        return StepOutput(
            request_id=request.request_id,
            index=index,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="abort",
            stop_reason=None,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=0,
        )
