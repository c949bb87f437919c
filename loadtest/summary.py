"""Summary statistics of a run: latency percentiles, throughput, goodput, errors, hit rates."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from loadtest.request import RequestResult
from loadtest.slo import Slo

PERCENTILES = (50, 90, 99)


def latency_stats(values_s: Iterable[float | None]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max, in milliseconds (None when there is no value)."""
    arr = np.array([v for v in values_s if v is not None], dtype=float) * 1e3
    if arr.size == 0:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    stats: dict[str, float | None] = {"count": int(arr.size), "mean": float(arr.mean())}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        stats[f"p{p}"] = float(v)
    stats["max"] = float(arr.max())
    return stats


def per_replica(results: list[RequestResult]) -> dict[str, dict[str, Any]]:
    """Requests and hit rate per serving replica, from the responses' usage (client side)."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        if not r.ok:
            continue
        row = out.setdefault(
            r.replica_id or "?", {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        )
        row["requests"] += 1
        row["prompt_tokens"] += r.prompt_tokens
        row["cached_tokens"] += r.cached_tokens
    for row in out.values():
        row["hit_rate"] = (
            row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else None
        )
    return dict(sorted(out.items()))


def error_samples(results: list[RequestResult]) -> dict[str, str]:
    """The first error message of each failure status (what a user needs to act on)."""
    samples: dict[str, str] = {}
    for r in results:
        if not r.ok and r.status not in samples:
            samples[r.status] = r.error[:300]
    return dict(sorted(samples.items()))


def summarize(
    results: list[RequestResult], slo: Slo | None = None, not_sent: int = 0
) -> dict[str, Any]:
    """Statistics over the measured (non-warm-up) requests."""
    measured = [r for r in results if not r.warmup]
    ok = [r for r in measured if r.ok]
    if measured:
        start = min(r.send_time for r in measured)
        duration = max(r.end_time for r in measured) - start
    else:
        duration = 0.0
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    fetched_tokens = sum(r.fetched_tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": {
            "sent": len(measured),
            "ok": len(ok),
            "failed": len(measured) - len(ok),
            "not_sent": not_sent,
            "by_status": dict(sorted(Counter(r.status for r in measured).items())),
            "finish_reasons": dict(sorted(Counter(r.finish_reason for r in ok).items())),
            "error_samples": error_samples(measured),
            "wrong_output_length": sum(r.output_tokens != r.expected_output_tokens for r in ok),
            "warmup": len(results) - len(measured),
        },
        "duration_s": duration,
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(output_tokens),
            "total_tokens_per_s": per_s(prompt_tokens + output_tokens),
        },
        "tokens": {
            "prompt": prompt_tokens,
            "output": output_tokens,
            "cached": cached_tokens,
            "fetched": fetched_tokens,  # of the cached ones, sent by a peer replica
        },
        "latency_ms": {
            "ttft": latency_stats(r.ttft for r in ok),
            "tpot": latency_stats(r.tpot for r in ok),
            "itl": latency_stats(x for r in ok for x in r.itl),
            "e2e": latency_stats(r.e2e for r in ok),
        },
        "send_lag_ms": latency_stats(r.send_lag for r in measured),
        "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
        "per_replica": per_replica(measured),
    }
    if slo is not None:
        good = sum(slo.met_by(r) for r in measured)
        summary["goodput"] = {
            "slo": slo.describe(),
            "requests": good,
            "requests_per_s": per_s(good),
            "fraction": good / len(measured) if measured else None,
        }
    return summary
