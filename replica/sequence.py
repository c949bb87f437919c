"""A request and its samples as the scheduler sees them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from prefixmesh.hashing import BlockHash
from replica.engine_request import EngineRequest
from replica.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """What the client asked for; its samples are ``Sequence``s (``n`` once forked)."""

    record: EngineRequest  # as the caller made it; read through the properties below
    prompt_token_ids: list[int]  # the prompt tokenized (record.prompt may be text)
    arrival_time: float  # record.arrival_time, else when the engine took it
    num_cached_tokens: int = -1  # set at first admission
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1 samples created (after the prompt's prefill)
    scheduled: bool = False  # has been given compute at least once

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def prompt(self) -> str | None:
        """The prompt's text, when it came as text."""
        prompt = self.record.prompt
        return prompt if isinstance(prompt, str) else None

    @property
    def params(self) -> SamplingParams:
        return self.record.params

    @property
    def priority(self) -> int:
        return self.record.priority

    @property
    def cache_salt(self) -> str:
        return self.record.cache_salt

    @property
    def tenant(self) -> str:
        """Whom fair scheduling charges (replica/tenant_share.py)."""
        return self.record.tenant

    @property
    def unsent_text(self) -> str:
        """Text of the prompt's tail (tokens resumed from an earlier replica) the client has
        not received: streamed with the first output, through stop-string matching."""
        return self.record.unsent_text

    @property
    def finished(self) -> bool:
        return (
            bool(self.sequences)
            and all(s.finished for s in self.sequences)
            and (self.forked or self.params.n == 1)
        )


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample: its tokens, its KV block table and how far its KV has been computed."""

    seq_id: int
    request: Request
    index: int  # sample index within the request
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, chained
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    num_computed_tokens: int = 0
    host_blocks: list[int] = field(default_factory=list)  # swapped-out KV, in table order
    kept_hashes: list[BlockHash] = field(default_factory=list)  # its prefix, kept while waiting
    num_queued_hashes: int = 0  # leading block_hashes counted in Scheduler.queued_hashes
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Per-sample output state, owned by the engine's output processor.
    state: object = None

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt (or recomputing after preemption) tokens."""
        return self.num_tokens - self.num_computed_tokens > 1
