"""Arrival schedules: when each request of a workload leaves (seconds after the run start)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadtest.request import LoadRequest


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    """``trace``: the workload's own times divided by ``speedup``; ``poisson``: exponential gaps
    at ``rate`` req/s; ``gamma``: gamma gaps at ``rate`` with shape ``burstiness`` (< 1 burstier
    than Poisson, 1 = Poisson, > 1 smoother); ``closed``: no times, ``concurrency`` workers each
    send the next request when their previous one finishes. ``rate = inf`` sends all at once.
    """

    kind: str = "poisson"
    rate: float = 10.0
    burstiness: float = 1.0
    speedup: float = 1.0
    concurrency: int = 8
    seed: int = 0


ARRIVAL_KINDS = ("trace", "poisson", "gamma", "closed")


def schedule(requests: list[LoadRequest], spec: ArrivalSpec) -> None:
    """Fill in ``planned_time`` for every request (in place); ``None`` for closed loop."""
    if spec.kind not in ARRIVAL_KINDS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVAL_KINDS)} (got {spec.kind!r})")
    if spec.kind == "closed":
        if spec.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (got {spec.concurrency})")
        for r in requests:
            r.planned_time = None
        return
    if spec.kind == "trace":
        if spec.speedup <= 0:
            raise ValueError(f"speedup must be > 0 (got {spec.speedup})")
        if any(r.planned_time is None for r in requests):
            raise ValueError("arrival 'trace' needs a trace workload (requests without times)")
        t0 = min((r.planned_time for r in requests), default=0.0)
        for r in requests:
            r.planned_time = (r.planned_time - t0) / spec.speedup
        return
    if spec.rate <= 0:
        raise ValueError(f"rate must be > 0 (got {spec.rate})")
    if math.isinf(spec.rate):
        for r in requests:
            r.planned_time = 0.0
        return
    rng = np.random.default_rng(spec.seed)
    n = len(requests)
    if spec.kind == "poisson":
        gaps = rng.exponential(1.0 / spec.rate, size=n)
    else:
        if spec.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0 (got {spec.burstiness})")
        gaps = rng.gamma(spec.burstiness, 1.0 / (spec.rate * spec.burstiness), size=n)
    gaps[:1] = 0.0  # the first request leaves at once
    for r, t in zip(requests, np.cumsum(gaps), strict=True):
        r.planned_time = float(t)
