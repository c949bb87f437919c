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
    assert sweep.window_starts(times, 4, limit=2) == [(0, 0.0), (2, 1.0), (4, 4.0), (6, 9.0)]
    assert sweep.window_starts(times[:2], 4, limit=1) == [(0, 0.0), (1, 1.0)]  # fewer than 4


def test_window_starts_leave_whole_windows_when_given_their_length() -> None:
    times = [1000.0 * i for i in range(10)]
    # Windows of 4: first requests 0..6, spread evenly, the last window ending with the trace.
    assert sweep.window_starts(times, 3, limit=4) == [(0, 0.0), (3, 3.0), (6, 6.0)]
    assert sweep.window_starts(times, 8, limit=8) == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert sweep.window_starts(times, 4, limit=10) == [(0, 0.0)]  # the trace is one window
    assert sweep.window_starts(times, 4, limit=50) == [(0, 0.0)]  # or less than one
    assert sweep.window_starts(times, 1, limit=4) == [(0, 0.0)]


def test_step_models_parse() -> None:
    assert sweep.step_models("20:2:10,10:1:20") == [(20.0, 2.0, 10.0), (10.0, 1.0, 20.0)]


def test_each_window_is_the_simulation_of_that_slice_of_the_trace(capsys) -> None:
    sweep.main([*FLAGS, "--windows", "2", "--seeds", "0", "--step-models", "20:2:10", "--json"])
    *rows, everything = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    trace = read_trace(SAMPLE_TRACE)
    assert [r["first_request"] for r in rows] == [0, len(trace) - 50]  # the last ends the trace
    assert all(r["requests"] == 50 and r["runs"] == 1 for r in rows)
    # The second window is what the simulator alone gives from that request's time.
    start = trace[len(trace) - 50].timestamp_ms / 1000
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


def test_paired_differences_are_per_window_in_points_with_their_standard_error() -> None:
    ours = [_window([0.90, 0.92], 1.1, 2.0), _window([1.0], 1.2, 1.0), _window([0.8], 1.0, 4.0)]
    base = [_window([0.90, 0.90], 1.1, 1.0), _window([0.98], 1.3, 1.0), _window([0.8], 1.0, 1.0)]
    got = sweep.paired(ours, base)
    # per-window differences: +1, +2 and 0 points; mean 1, standard deviation 1, three windows
    assert got["diff_points"] == pytest.approx(1.0)
    assert got["diff_se"] == pytest.approx(1 / 3**0.5, abs=1e-3)
    assert got["windows_ahead"] == 2 and got["windows_behind"] == 0
    assert got["ttft_ratio"] == pytest.approx(2.0)  # (2 * 1 * 4) ** (1/3)
    shifted = [sweep.WindowResult(0.0, 7, 10, 0.5, [1.0], 1.0, {}, [1.0])]
    with pytest.raises(ValueError, match="same windows"):
        sweep.paired(shifted, base[:1])


def test_a_baseline_sweep_runs_the_same_windows_and_reports_the_paired_difference(capsys) -> None:
    flags = [*FLAGS[:-1], "--windows", "2", "--seeds", "0", "--step-models", "20:2:10", "--json"]
    sweep.main([*flags, "--baseline", "--compare round_robin"])  # no --fetch: no fetched hits
    *rows, everything = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sweep.main([*flags, "--compare", "round_robin"])
    *base_rows, base = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # The baseline's own numbers are those of a sweep run with its flags, and the difference is
    # taken window by window.
    assert everything["baseline_mean"] == base["mean"]
    assert everything["baseline_worst_skew"] == base["worst_skew"]
    diffs = [100 * (r["mean"] - b["mean"]) for r, b in zip(rows, base_rows)]
    assert everything["diff_points"] == pytest.approx(sum(diffs) / 2, abs=0.1)
    assert everything["diff_points"] > 0  # cache_aware keeps more than round robin
    with pytest.raises(SystemExit):
        sweep.main([*flags, "--baseline", "--windows 3"])
