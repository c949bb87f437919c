"""The bookkeeping of ``prefixmesh tune``: points, measurements, the budget, resuming, the pick.

A ``Point`` is one setting of the engine knobs (and the router policy). ``Search`` measures the
defaults first, then walks the knobs one at a time (coordinate search): for each knob it tries
the neighbours of the best point so far (half and double, within the knob's range) and moves
when a neighbour serves more goodput at the SLO; it stops when no neighbour improves or the
budget cannot pay for one more measurement. Every measurement is appended to a JSON-lines
results file as soon as it is taken, so an interrupted run keeps what it measured and a rerun
with the same file skips those points. The runner is anything with ``measure(point)``: the real
one (loadtest/tune.py) starts replicas on the real model; tests pass a fake one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Point:
    """One setting of the knobs; the defaults are the replica's and router's own."""

    max_num_batched_tokens: int = 1024  # the step's token budget, which is also the prefill chunk
    max_num_seqs: int = 128
    kv_cache_gb: float = 1.0  # the KV pool's share of memory
    policy: str = "cache_aware"  # only searched with --replicas > 1

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


# knob -> (lowest, highest): neighbours are half and double the current value, within these.
RANGES: dict[str, tuple[float, float]] = {
    "max_num_batched_tokens": (64, 8192),
    "max_num_seqs": (1, 256),
    "kv_cache_gb": (0.0625, 4.0),
}
POLICIES = ("cache_aware", "load", "round_robin")


@dataclass(frozen=True, slots=True)
class PercentileSlo:
    """Percentile targets in milliseconds (None: no target)."""

    ttft_p90: float | None = None
    ttft_p99: float | None = None
    itl_p90: float | None = None
    itl_p99: float | None = None

    def met(self, m: Measurement) -> bool:
        return all(
            target is None or (got is not None and got <= target)
            for target, got in (
                (self.ttft_p90, m.ttft_p90), (self.ttft_p99, m.ttft_p99),
                (self.itl_p90, m.itl_p90), (self.itl_p99, m.itl_p99),
            )
        )  # fmt: skip


@dataclass(slots=True)
class Measurement:
    """What one replay of the workload at ``point`` gave (latencies in ms)."""

    point: Point
    throughput_rps: float
    goodput_rps: float  # requests per second that met every per-request SLO bound
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p90: float | None
    itl_p99: float | None
    hit_rate: float | None = None
    preemptions: int = 0
    recomputed_tokens: int = 0
    output_tokens_per_s: float = 0.0
    seconds: float = 0.0  # what the measurement cost, startup included
    error: str = ""  # the run failed (a knob the replica refused, a crash): never picked

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> Measurement:
        d = json.loads(line)
        return cls(**{**d, "point": Point(**d["point"])})


class Runner(Protocol):
    def measure(self, point: Point, limit_s: float) -> Measurement:
        """Replay the workload at ``point``, giving up after ``limit_s`` seconds."""
        ...


def neighbours(point: Point, knob: str) -> Iterator[Point]:
    """Half and double ``knob`` (integers stay integers), or the other policies."""
    if knob == "policy":
        yield from (replace(point, policy=p) for p in POLICIES if p != point.policy)
        return
    lo, hi = RANGES[knob]
    value = getattr(point, knob)
    for v in (value / 2, value * 2):
        v = int(v) if isinstance(value, int) else v
        if lo <= v <= hi and v != value:
            yield replace(point, **{knob: v})


@dataclass
class Search:
    """Coordinate search under a budget of ``budget_s`` seconds, resumable from ``results``."""

    runner: Runner
    slo: PercentileSlo
    budget_s: float
    results: Path
    knobs: tuple[str, ...] = ("max_num_batched_tokens", "max_num_seqs", "kv_cache_gb")
    start: Point = field(default_factory=Point)
    clock: Callable[[], float] = time.monotonic
    progress: Callable[[str], None] = lambda _msg: None
    measured: dict[str, Measurement] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.results.exists():  # resume: what an earlier run measured is not measured again
            for line in self.results.read_text().splitlines():
                if line.strip():
                    m = Measurement.from_json(line)
                    self.measured[m.point.key()] = m
        self._t0 = self.clock()

    def score(self, m: Measurement) -> tuple[int, float]:
        """Points that meet the SLO first, then goodput, then throughput."""
        return (int(not m.error and self.slo.met(m)), m.goodput_rps if not m.error else -1.0)

    def _estimate(self) -> float:
        """The next measurement's cost: the longest one so far (0 before the first)."""
        costs = [m.seconds for m in self.measured.values()]
        return max(costs) if costs else 0.0

    def affordable(self) -> bool:
        return self.clock() - self._t0 + self._estimate() <= self.budget_s

    def get(self, point: Point) -> Measurement | None:
        """The point's measurement, taking it if the budget allows (None when it does not)."""
        if (m := self.measured.get(point.key())) is not None:
            return m
        if not self.affordable():
            return None
        self.progress(f"[{self.clock() - self._t0:6.0f}s / {self.budget_s:.0f}s] measuring {point}")
        # The runner is held to what is left, so one slow point cannot overrun the budget.
        m = self.runner.measure(point, self.budget_s - (self.clock() - self._t0))
        self.measured[point.key()] = m
        with self.results.open("a") as f:
            f.write(m.to_json() + "\n")
        verdict = f"error: {m.error}" if m.error else f"SLO met: {self.slo.met(m)}"
        self.progress(f"    -> goodput {m.goodput_rps:.3f} req/s, {verdict}")
        return m

    def run(self) -> Measurement | None:
        """Measure until no neighbour improves or the budget is spent; the best point."""
        best = self.get(self.start)
        if best is None:
            return None
        improved = True
        while improved:
            improved = False
            for knob in self.knobs:
                for cand in list(neighbours(best.point, knob)):
                    m = self.get(cand)
                    if m is None:
                        return self.best()
                    if self.score(m) > self.score(best):
                        best, improved = m, True
        return self.best()

    def best(self) -> Measurement | None:
        """The pick: the best score over everything measured (this run and resumed ones)."""
        ok = [m for m in self.measured.values() if not m.error]
        return max(ok, key=self.score) if ok else None
