"""What the engine hands back: per-step deltas for streaming, and whole results for ``LLM``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of a sampled token and its top-k alternatives (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class StepOutput:
    """What one sample of one request produced in one engine step (a streaming delta).

    The last delta of a sample has ``finished`` set, with ``finish_reason`` one of ``"stop"``
    (EOS, stop token or stop string), ``"length"`` (max_tokens or the model's context) or
    ``"abort"``; ``stop_reason`` then names the stop string or token id that matched.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One finished sample."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A whole request: its prompt, cache hit and its samples (``n`` of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False

    # The first sample's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
