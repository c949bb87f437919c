"""What the engine takes for one request: one record from the server's wire mapping (or ``LLM``),
through the engine loop, into ``LLMEngine.add``, held by the scheduler's ``sequence.Request``."""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.hashing import BlockHash
from prefixmesh.tenants import DEFAULT_TENANT
from replica.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """One request: what to run (``prompt``: text or token ids) and how (``params``).

    ``unsent_text`` is text of the prompt's tail the client has not received yet (tokens an
    earlier replica generated, held back there for a possible stop string): it leads the first
    output, through the stop-string matcher. ``arrival_time`` is monotonic seconds (None: when
    the engine takes the request). ``cache_salt`` is "" for none (None is taken as ""), as on
    the wire. ``tenant`` is whom fair scheduling charges the request to (the server's
    prefixmesh/tenants.py ``tenant_of``; unset: its ``cache_salt``, else ``default``).
    ``block_hashes``: the chained hashes of the prompt's full blocks, when the server computed
    them already (``LLMEngine.prompt_block_hashes``, for the peer-fetch decision); the engine
    computes them otherwise.
    """

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str = ""
    arrival_time: float | None = None
    unsent_text: str = ""
    tenant: str = ""
    block_hashes: list[BlockHash] | None = None

    def __post_init__(self) -> None:
        # The one place salt and tenant are normalised: every reader after this sees a str.
        if self.cache_salt is None:
            self.cache_salt = ""
        if not isinstance(self.cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if not self.tenant:
            self.tenant = self.cache_salt or DEFAULT_TENANT
