"""What an unset ``n`` or ``max_tokens`` in a request means: one place for every reader.

The replica's engine (``replica.SamplingParams``), the router (load and resume budgets), the
OpenAI door and the echo servers all read a ``GenerateRequest``'s sampling fields through
these, so they agree on the defaults. Torch-free and proto-free (duck-typed on ``HasField``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proto.prefixmesh_pb2 import SamplingParams

DEFAULT_N = 1
DEFAULT_MAX_TOKENS = 16  # vLLM's default


def requested_n(sp: SamplingParams) -> int:
    """Samples asked for: unset (or not positive, which a replica rejects) means one."""
    return sp.n if sp.HasField("n") and sp.n > 0 else DEFAULT_N


def requested_max_tokens(sp: SamplingParams, default: int = DEFAULT_MAX_TOKENS) -> int:
    """Tokens to generate per sample: ``default`` when unset; a set value as it is."""
    return sp.max_tokens if sp.HasField("max_tokens") else default
