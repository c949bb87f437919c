"""``python -m loadtest.sweep``: the simulator on windows spread over a trace."""

from __future__ import annotations

import json

import pytest

from loadtest import simulate, sweep
from loadtest.trace import read_trace
from loadtest.workload import SAMPLE_TRACE

FLAGS = [
    "--trace",
    str(SAMPLE_TRACE),
    "--tokens-per-hash-id",
    "16",
    "--max-output-tokens",
    "4",
    "--limit",
    "50",
    "--fetch",
]


def test_window_starts_spread_evenly_over_the_trace() -> None:
    times = [0.0, 1000.0, 1000.0, 2500.0, 4000.0, 7000.0, 9000.0, 9500.0]
    assert sweep.window_starts(times, 4) == [(0, 0.0), (2, 1.0), (4, 4.0), (6, 9.0)]
    assert sweep.window_starts(times[:2], 4) == [(0, 0.0), (1, 1.0)]  # fewer requests than windows


def test_step_models_parse() -> None:
    assert sweep.step_models("20:2:10,10:1:20") == [(20.0, 2.0, 10.0), (10.0, 1.0, 20.0)]


def test_each_window_is_the_simulation_of_that_slice_of_the_trace(capsys) -> None:
    sweep.main([*FLAGS, "--windows", "2", "--seeds", "0", "--step-models", "20:2:10", "--json"])
    *rows, everything = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    trace = read_trace(SAMPLE_TRACE)
    assert [r["first_request"] for r in rows] == [0, len(trace) // 2]
    assert all(r["requests"] == 50 and r["runs"] == 1 for r in rows)
    # The second window is what the simulator alone gives from that request's time.
    start = trace[len(trace) // 2].timestamp_ms / 1000
    simulate.main([*FLAGS, "--trace-start", str(start), "--json", "--no-progress"])
    out = capsys.readouterr().out.splitlines()
    capacity = float(out[0].split("capacity-aware ")[1].split()[0])
    alone = json.loads(out[1])
    assert rows[1]["capacity_ceiling"] == pytest.approx(capacity, abs=1e-4)
    assert rows[1]["worst"] == pytest.approx(alone["of_capacity_ceiling"], abs=1e-3)
    assert rows[1]["worst_skew"] == pytest.approx(alone["max/mean requests"], abs=1e-3)
    assert rows[1]["ttft_p50_s"] == pytest.approx(alone["ttft_p50_s"], abs=0.01)
    # The last line sums the windows up.
    assert everything["window"] == "all" and everything["windows"] == 2
    assert everything["mean"] == pytest.approx((rows[0]["mean"] + rows[1]["mean"]) / 2, abs=1e-3)
    assert everything["worst"] == min(r["worst"] for r in rows)
    assert everything["worst_skew"] == max(r["worst_skew"] for r in rows)


def _window(achieved: list[float], skew: float, ttft: float) -> sweep.WindowResult:
    return sweep.WindowResult(0.0, 0, 10, 0.5, achieved, skew, {}, [ttft] * len(achieved))


def test_the_summary_weighs_windows_alike_and_takes_the_geometric_mean_ttft() -> None:
    results = [_window([0.8, 1.0, 1.0, 1.0], 1.1, 0.1), _window([0.95, 0.95], 1.25, 10.0)]
    summary = sweep.summarize(results, floor=0.9)
    assert summary["mean"] == pytest.approx((0.95 + 0.95) / 2)  # not the mean of the six runs
    assert summary["worst"] == 0.8 and summary["below_floor"] == 1 and summary["runs"] == 6
    assert summary["worst_skew"] == 1.25
    assert summary["ttft_p50_s"] == pytest.approx(1.0)  # sqrt(0.1 * 10)
    assert sweep.summarize([_window([1.0], 1.0, 0.0)], floor=0.9)["ttft_p50_s"] == 0.0
