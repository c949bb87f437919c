"""Mooncake-format traces: JSONL rows with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (one id per 512-token block, forming a prefix tree).

Each hash id becomes one fixed block of ``tokens_per_hash_id`` token ids (``TokenBlocks``), so the
trace's cache structure is reproduced exactly while the prompts shrink to what a CPU can serve:
a request's prompt is ``input_length * tokens_per_hash_id / 512`` tokens, the concatenation of
its hash ids' blocks with the last one cut short.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from loadtest.request import LoadRequest
from loadtest.text import TextBlocks, trace_text
from loadtest.tokens import TokenBlocks

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One Mooncake trace record."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """How to shrink and cut a trace."""

    tokens_per_hash_id: int = 16
    max_output_tokens: int | None = None
    max_input_tokens: int | None = None
    start_s: float = 0.0  # trace window start, trace seconds after the first row
    window_s: float | None = None  # trace window length, trace seconds
    limit: int | None = None


def read_trace(path: str | Path) -> list[TraceRow]:
    rows: list[TraceRow] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append(
                    TraceRow(
                        timestamp_ms=float(d["timestamp"]),
                        input_length=int(d["input_length"]),
                        output_length=int(d["output_length"]),
                        hash_ids=tuple(int(h) for h in d["hash_ids"]),
                    )
                )
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace row ({e})") from e
    rows.sort(key=lambda r: r.timestamp_ms)
    return rows


def scaled_input_length(row: TraceRow, tokens_per_hash_id: int) -> int:
    """Prompt length after shrinking every 512-token block to ``tokens_per_hash_id`` tokens."""
    n = math.ceil(row.input_length * tokens_per_hash_id / MOONCAKE_BLOCK_TOKENS)
    return max(1, min(n, len(row.hash_ids) * tokens_per_hash_id)) if row.hash_ids else max(1, n)


def trace_requests(
    rows: list[TraceRow], blocks: TokenBlocks, opts: TraceOptions, texts: TextBlocks | None = None
) -> list[LoadRequest]:
    """Turn trace rows into requests; ``planned_time`` is trace time (s) from the window start.
    With ``texts``, each request also gets a text prompt of the same blocks (``trace_text``)."""
    if blocks.block_len != opts.tokens_per_hash_id:
        raise ValueError("TokenBlocks.block_len must equal tokens_per_hash_id")
    if not rows:
        return []
    t0 = rows[0].timestamp_ms / 1000.0 + opts.start_s
    requests: list[LoadRequest] = []
    for row in rows:
        t = row.timestamp_ms / 1000.0 - t0
        if t < 0:
            continue
        if opts.window_s is not None and t > opts.window_s:
            break
        if opts.limit is not None and len(requests) >= opts.limit:
            break
        n = scaled_input_length(row, opts.tokens_per_hash_id)
        if opts.max_input_tokens is not None:
            n = min(n, opts.max_input_tokens)
        tokens: list[int] = []
        for h in row.hash_ids:
            if len(tokens) >= n:
                break
            tokens.extend(blocks.block(h))
        if len(tokens) < n:  # a row without hash ids: a prompt of its own
            tokens.extend(blocks.random(n - len(tokens), 1, len(requests)))
        out = max(1, row.output_length)
        if opts.max_output_tokens is not None:
            out = min(out, opts.max_output_tokens)
        requests.append(
            LoadRequest(
                index=len(requests),
                token_ids=tokens[:n],
                max_tokens=out,
                planned_time=t,
                group=row.hash_ids[0] if row.hash_ids else None,
                trace_timestamp_ms=row.timestamp_ms,
                text=None
                if texts is None
                else trace_text(row.hash_ids, n, blocks.block_len, texts),
            )
        )
    return requests
