"""The records that flow through the load tester: what to send and what came back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class LoadRequest:
    """One request of a workload, sent as token ids with an exact output length.

    ``text``, when set (``--prompt-format text``), is sent as the prompt instead of the token
    ids, which then stand for it in offline computations (ceilings, simulation).

    ``planned_time`` is seconds after the start of the run (filled in by the arrival schedule);
    ``None`` in closed-loop mode, where a request goes as soon as a worker is free.
    """

    index: int
    token_ids: list[int]
    max_tokens: int
    planned_time: float | None = None
    group: int | None = None  # shared-prefix group, conversation or trace prefix family
    turn: int | None = None  # multi-turn conversations: 0 for the first turn
    trace_timestamp_ms: float | None = None
    cache_salt: str = ""
    text: str | None = None


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are ``time.perf_counter`` seconds after the run start.

    ``status`` is ``"OK"`` or a gRPC status name (``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` ...);
    ``INCOMPLETE`` when the stream ended without a finish reason, ``RUN_TIMEOUT`` when the run's
    deadline cut the request off.
    """

    index: int
    warmup: bool = False
    planned_time: float | None = None
    send_time: float = 0.0
    first_token_time: float | None = None
    end_time: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    cached_tokens: int = 0
    fetched_tokens: int = 0  # of cached_tokens, fetched from a peer replica
    replica_id: str = ""
    finish_reason: str = ""
    status: str = "OK"
    error: str = ""
    group: int | None = None
    turn: int | None = None
    itl: list[float] = field(default_factory=list)  # gaps between token-bearing messages (s)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for one-token answers)."""
        if self.first_token_time is None or self.output_tokens < 2:
            return None
        return (self.end_time - self.first_token_time) / (self.output_tokens - 1)

    @property
    def send_lag(self) -> float | None:
        """How late the request left compared with its planned time (open loop only)."""
        return None if self.planned_time is None else self.send_time - self.planned_time

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e, send_lag=self.send_lag)
        return row
