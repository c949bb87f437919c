"""``prefixmesh tune``'s bookkeeping on a fake runner: it resumes after an interruption, never
spends more than its budget, respects the SLO in its pick; and the command line it prints
parses back into the same settings."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from loadtest.tune import command_line, replica_flags
from loadtest.tune_search import Measurement, PercentileSlo, Point, Search

SLO = PercentileSlo(ttft_p99=1000.0)


class FakeRunner:
    """A made-up response surface: goodput grows with max_num_seqs, but TTFT p99 crosses the
    SLO above 256 sequences; each measurement costs ``cost`` seconds on a fake clock."""

    def __init__(self, clock: list[float], cost: float = 10.0, fail_after: int | None = None):
        self.clock, self.cost, self.fail_after = clock, cost, fail_after
        self.calls: list[Point] = []

    def measure(self, point: Point, limit_s: float) -> Measurement:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt  # the user pressed ^C mid-search
        self.calls.append(point)
        spent = min(self.cost, limit_s)
        self.clock[0] += spent
        good = point.max_num_seqs / 10 + point.max_num_batched_tokens / 1000
        ttft = 800.0 if point.max_num_seqs <= 128 else 1500.0
        return Measurement(point, good, good, ttft, ttft, 10, 20, seconds=spent)


def _search(tmp_path, runner, clock, budget=1000.0, **kw) -> Search:
    return Search(runner, SLO, budget, tmp_path / "results.jsonl", clock=lambda: clock[0], **kw)


def test_pick_respects_the_slo(tmp_path):
    clock = [0.0]
    best = _search(tmp_path, FakeRunner(clock), clock).run()
    assert best.point.max_num_seqs == 128  # 256 serves more, but misses the TTFT p99 target
    assert SLO.met(best)
    assert best.point.max_num_batched_tokens == 8192  # the knob's ceiling: more always helped


def test_never_exceeds_its_budget(tmp_path):
    clock = [0.0]
    runner = FakeRunner(clock, cost=30.0)
    search = _search(tmp_path, runner, clock, budget=100.0)
    search.run()
    assert clock[0] <= 100.0
    assert len(runner.calls) == 3  # a fourth would have ended at 120 s


def test_resumes_after_interruption(tmp_path):
    clock = [0.0]
    with pytest.raises(KeyboardInterrupt):
        _search(tmp_path, FakeRunner(clock, fail_after=3), clock).run()
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3
    clock = [0.0]
    again = FakeRunner(clock)
    full = _search(tmp_path, again, clock).run()
    first_three = [Point(), Point(max_num_batched_tokens=512), Point(max_num_batched_tokens=2048)]
    assert not set(map(Point.key, first_three)) & set(map(Point.key, again.calls))
    (tmp_path / "x").mkdir()
    clock = [0.0]
    fresh = _search(tmp_path / "x", FakeRunner(clock), clock)
    assert full.point == fresh.run().point  # resuming finds what an uninterrupted run finds


def test_a_failed_point_is_never_picked(tmp_path):
    clock = [0.0]

    class Failing(FakeRunner):
        def measure(self, point, limit_s):
            m = super().measure(point, limit_s)
            return replace(m, error="replica refused") if point.kv_cache_gb != 1.0 else m

    search = _search(tmp_path, Failing(clock), clock)
    assert search.run().point.kv_cache_gb == 1.0


@pytest.mark.parametrize("replicas", [1, 3])
def test_printed_command_parses_back(replicas):
    from replica.server.config import parse_config

    point = Point(max_num_batched_tokens=512, max_num_seqs=32, kv_cache_gb=0.5, policy="load")
    argv = shlex.split(command_line(point, replicas))
    assert argv[:2] == ["prefixmesh", "replica" if replicas == 1 else "up"]
    if replicas > 1:
        assert argv[argv.index("--replicas") + 1] == "3" and "--policy=load" not in argv
        assert argv[argv.index("--policy") + 1] == "load"
        argv = [a.split("=", 1)[1] for a in argv if a.startswith("--replica-arg=")]
    else:
        argv = argv[2:]
    assert argv == replica_flags(point)
    config = parse_config(argv)
    got = (config.max_num_batched_tokens, config.max_num_seqs, config.kv_cache_gb)
    assert got == (512, 32, 0.5)
