"""What the engine takes for one request: one record from the server's wire mapping, through
the engine loop, into ``LLMEngine.add`` (``LLM`` and tests may use ``add_request``'s keywords)."""

from __future__ import annotations

from dataclasses import dataclass

from replica.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """One request: what to run (``prompt``: text or token ids) and how (``params``).

    ``unsent_text`` is text of the prompt's tail the client has not received yet (tokens an
    earlier replica generated, held back there for a possible stop string): it leads the first
    output, through the stop-string matcher. ``arrival_time`` is monotonic seconds (None: when
    the engine takes the request). ``tenant`` is whom fair scheduling charges the request to
    (prefixmesh/tenants.py's ``tenant_of``; None: its ``cache_salt``, else ``default``).
    """

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float | None = None
    unsent_text: str = ""
    tenant: str | None = None
