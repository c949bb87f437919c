"""Per-request sampling parameters, with vLLM's defaults and field-naming validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixmesh.request_defaults import DEFAULT_MAX_TOKENS, DEFAULT_N


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` is greedy.

    ``top_k`` of 0 or -1 disables top-k; ``seed`` makes a request reproducible whatever else
    shares its batch; ``stop`` strings are matched on the detokenized text, also across token
    boundaries; ``logprobs=k`` returns the top-k log-probabilities of every generated token.
    """

    n: int = DEFAULT_N
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be >= 1 (got {self.n})")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}] (got {self.min_tokens})"
            )
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1 (got {self.top_k})")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (got {self.min_p})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20] (got {self.logprobs})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings (got {self.stop!r})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative token ids (got {self.stop_token_ids!r})"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer (got {self.seed!r})")
