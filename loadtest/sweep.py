"""``python -m loadtest.sweep``: the routing simulator on windows spread across a whole trace.

A policy tuned on a trace's first window can still lose hits on a later one, where the mix of
new and returning prefixes differs (and a held-out trace is judged on windows nobody tuned on).
This runs ``loadtest.simulate`` on ``--windows`` windows of ``--limit`` requests whose first
requests are spread evenly over the trace (the last window ends with it), each under every step
model and seed given, and prints one row per window: its capacity-aware ceiling, the achieved
hit rate over it (mean and worst run, and how many runs fell below ``--floor``), the worst
max/mean requests per replica, the largest share of blocks lost to each miss kind, and the
median run's TTFT p50. A last row sums up all windows (``summarize``): the mean of the windows'
means, the worst run, the runs below the floor, the worst max/mean, and the geometric mean of
the windows' TTFT p50s, the numbers by which docs/benchmarks.md compares policies. ``--baseline
FLAGS`` sweeps the same windows again with ``FLAGS`` added and adds the paired difference to
that row (``paired``). The other flags are ``python -m loadtest.simulate``'s (workload, cluster,
policy flags).

```bash
python -m loadtest.sweep --trace ../shared/data/traces/synthetic_trace.jsonl \
    --tokens-per-hash-id 16 --max-output-tokens 4 --limit 300 --fetch        # trace arrivals
python -m loadtest.sweep ... --limit 1000 --arrival closed --concurrency 8 --fetch
```
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import statistics
import sys
from dataclasses import dataclass

from loadtest.ceilings import ceiling
from loadtest.simulate import engine_model, policy_factory, simulate, simulation_parser
from loadtest.trace import read_trace
from loadtest.workload import SAMPLE_TRACE, build_workload
from router.attribution import MISS_KINDS

DEFAULT_STEP_MODELS = "20:2:10,10:1:20,30:4:5"


@dataclass(frozen=True, slots=True)
class WindowResult:
    """One window over every step model and seed."""

    start_s: float  # trace seconds
    first_request: int  # its index in the trace
    requests: int
    capacity_ceiling: float
    achieved: list[float]  # hit rate over the capacity-aware ceiling, one per run
    worst_skew: float  # max/mean requests per replica, the worst run
    worst_miss_share: dict[str, float]  # per miss kind, the largest share of blocks in a run
    ttft_p50_s: list[float]  # each run's TTFT p50 (simulated seconds)

    @property
    def mean(self) -> float:
        return sum(self.achieved) / len(self.achieved)

    @property
    def ttft(self) -> float:
        """The median run's TTFT p50."""
        return statistics.median(self.ttft_p50_s)

    def below(self, floor: float) -> int:
        """Runs whose hit rate fell below ``floor`` of the ceiling."""
        return sum(x < floor for x in self.achieved)

    def row(self, floor: float) -> dict[str, float]:
        return {
            "start_s": round(self.start_s, 1),
            "first_request": self.first_request,
            "requests": self.requests,
            "capacity_ceiling": round(self.capacity_ceiling, 4),
            "mean": round(self.mean, 3),
            "worst": round(min(self.achieved), 3),
            "below_floor": self.below(floor),
            "runs": len(self.achieved),
            "worst_skew": round(self.worst_skew, 3),
            "ttft_p50_s": round(self.ttft, 3),
            **{k: round(v, 4) for k, v in self.worst_miss_share.items()},
        }


def summarize(results: list[WindowResult], floor: float) -> dict[str, float | str]:
    """Every window at once: windows weigh the same whatever their runs, and the TTFT is the
    geometric mean of the windows' (their medians differ by orders of magnitude between a
    closed loop and an overloaded window; a window that served nothing reads 0 and is left
    out of it)."""
    ttfts = [r.ttft for r in results if r.ttft > 0]
    return {
        "window": "all",
        "windows": len(results),
        "mean": round(sum(r.mean for r in results) / len(results), 4),
        "worst": round(min(min(r.achieved) for r in results), 3),
        "below_floor": sum(r.below(floor) for r in results),
        "runs": sum(len(r.achieved) for r in results),
        "worst_skew": round(max(r.worst_skew for r in results), 3),
        "ttft_p50_s": round(math.exp(statistics.fmean(map(math.log, ttfts))), 3) if ttfts else 0.0,
    }


def paired(results: list[WindowResult], baseline: list[WindowResult]) -> dict[str, float]:
    """This sweep against ``baseline``'s on the same windows, step models and seeds: the mean
    of the per-window differences of mean hit rate, in points of the capacity-aware ceiling,
    with its standard error over the windows (each window's runs share its requests, so the
    window is the unit; pairing removes what the window itself decides, the noise that
    dwarfs a policy's effect when two sweeps' means are compared unpaired), how many windows
    went each way, and the geometric mean of the windows' TTFT p50 ratios."""
    if [r.first_request for r in results] != [b.first_request for b in baseline]:
        raise ValueError("paired sweeps need the same windows")
    diffs = [100 * (r.mean - b.mean) for r, b in zip(results, baseline)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    ratios = [r.ttft / b.ttft for r, b in zip(results, baseline) if r.ttft > 0 and b.ttft > 0]
    ttft_ratio = math.exp(statistics.fmean(map(math.log, ratios))) if ratios else 1.0
    return {
        "diff_points": round(statistics.fmean(diffs), 3),
        "diff_se": round(se, 3),
        "windows_ahead": sum(d > 0 for d in diffs),
        "windows_behind": sum(d < 0 for d in diffs),
        "ttft_ratio": round(ttft_ratio, 4),
    }


def window_starts(timestamps_ms: list[float], windows: int, limit: int) -> list[tuple[int, float]]:
    """``windows`` first requests spread evenly over the trace, each leaving a whole window of
    ``limit`` requests, the last window ending with the trace: (index, trace seconds). (A window
    cut short by the trace's end is a different, smaller workload, and its max/mean requests
    over a few dozen decisions say little about balance.)"""
    span = max(0, len(timestamps_ms) - limit)  # the last first request that leaves a whole window
    picks = {round(i * span / (windows - 1)) for i in range(windows)} if windows > 1 else {0}
    return [(i, timestamps_ms[i] / 1000) for i in sorted(picks)]


def step_models(spec: str) -> list[tuple[float, float, float]]:
    """``step:prefill:decode`` ms triples, comma separated."""
    out = []
    for part in spec.split(","):
        step, prefill, decode = (float(x) for x in part.split(":"))
        out.append((step, prefill, decode))
    return out


def sweep_window(
    args: argparse.Namespace,
    start_s: float,
    first: int,
    models: list[tuple[float, float, float]],
    seeds: list[int],
) -> WindowResult:
    """Every step model and seed on the window from ``start_s``. The seeds change the token
    ids, not which blocks repeat, so every seed has the same ceiling."""
    concurrency = args.concurrency if args.arrival == "closed" else None
    capacity = args.num_blocks * args.replicas
    achieved: list[float] = []
    ttft: list[float] = []
    skew = 0.0
    worst = dict.fromkeys(MISS_KINDS, 0.0)
    cap, count = 0.0, 0
    for seed in seeds:
        wargs = copy.copy(args)
        wargs.trace_start, wargs.seed = start_s, seed
        requests = build_workload(wargs)
        count = len(requests)
        cap = ceiling(requests, args.sim_block_size, capacity).hit_rate
        for step, prefill, decode in models:
            wargs.step_ms, wargs.prefill_ms, wargs.decode_ms = step, prefill, decode
            res = simulate(
                requests, args.compare, args.replicas, engine_model(wargs), concurrency,
                policy_factory(wargs), args.cold_placement, args.balance_window,
            )  # fmt: skip
            achieved.append(res.hit_rate / cap if cap else 1.0)
            ttft.append(res.ttft_p50_s)
            skew = max(skew, res.skew)
            total = res.misses["cacheable"] or 1
            for kind in MISS_KINDS:
                worst[kind] = max(worst[kind], res.misses[kind] / total)
    return WindowResult(start_s, first, count, cap, achieved, skew, worst, ttft)


def main(argv: list[str] | None = None) -> int:
    parser = simulation_parser("python -m loadtest.sweep")
    g = parser.add_argument_group("sweep")
    g.add_argument("--windows", type=int, default=8, help="windows spread over the trace")
    g.add_argument(
        "--step-models", default=DEFAULT_STEP_MODELS,
        help="step:prefill:decode ms per engine step (fixed, per prefilled token, per "
        "decoding sequence), comma separated; each window runs under every one",
    )  # fmt: skip
    g.add_argument("--seeds", default="0,1", help="token seeds, comma separated")
    g.add_argument(
        "--baseline", metavar="FLAGS",
        help="also sweep the same windows with these flags added (for example "
        "'--compare sglang_cache_aware' or '--cold-by load'), and print the paired difference",
    )  # fmt: skip
    g.add_argument(
        "--floor", type=float, default=0.9,
        help="count the runs whose hit rate is below this share of the capacity-aware ceiling",
    )  # fmt: skip
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _checked(parser, parser.parse_args(argv))
    results = run_sweep(args)
    base: dict[str, float | str] = {}
    if args.baseline:
        base_args = _checked(parser, parser.parse_args([*argv, *shlex.split(args.baseline)]))
        if (base_args.windows, base_args.limit, base_args.seeds, base_args.step_models) != (
            args.windows, args.limit, args.seeds, args.step_models
        ):  # fmt: skip
            parser.error("--baseline: flags that change the windows or runs cannot be paired")
        baseline = run_sweep(base_args)
        base = {
            **{f"baseline_{k}": v for k, v in summarize(baseline, args.floor).items()},
            **paired(results, baseline),
        }
        del base["baseline_window"], base["baseline_windows"]
    if args.json:
        for r in results:
            print(json.dumps(r.row(args.floor)))
        print(json.dumps(summarize(results, args.floor) | base))
    else:
        _print_table(results, args.floor)
        if base:
            _print_paired(base)
    return 0


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    args.workload = "trace"
    if args.limit is None:
        parser.error("--limit: the window's length in requests")
    args.compare = args.compare or "cache_aware"
    if "," in args.compare:
        parser.error("--compare: one policy per sweep")
    return args


def run_sweep(args: argparse.Namespace) -> list[WindowResult]:
    """Every window of ``args``: ``--windows`` whole windows of ``--limit`` requests."""
    times = [r.timestamp_ms for r in read_trace(args.trace or SAMPLE_TRACE)]
    models = step_models(args.step_models)
    seeds = [int(s) for s in args.seeds.split(",")]
    return [
        sweep_window(args, start_s, first, models, seeds)
        for first, start_s in window_starts(times, args.windows, args.limit)
    ]


def _print_table(results: list[WindowResult], floor: float) -> None:
    kinds = MISS_KINDS[1:]  # compulsory is the same for every policy
    print(f"| first request (trace s) | requests | capacity-aware ceiling | achieved / ceiling, "
          f"mean | worst | runs below {floor:g} | worst max/mean requests | worst "
          f"{' / '.join(kinds)} | TTFT p50, median run |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        misses = " / ".join(f"{100 * r.worst_miss_share[k]:.1f}%" for k in kinds)
        print(f"| {r.first_request} ({r.start_s:.1f}) | {r.requests} | "
              f"{100 * r.capacity_ceiling:.1f}% | {r.mean:.3f} | {min(r.achieved):.3f} | "
              f"{r.below(floor)} of {len(r.achieved)} | {r.worst_skew:.2f} | {misses} | "
              f"{r.ttft:.2f} s |")  # fmt: skip
    a = summarize(results, floor)
    print(f"| all {a['windows']} windows | | | **{a['mean']:.3f}** | {a['worst']:.3f} | "
          f"{a['below_floor']} of {a['runs']} | {a['worst_skew']:.2f} | | "
          f"{a['ttft_p50_s']:.2f} s (geometric mean) |")  # fmt: skip


def _print_paired(base: dict[str, float | str]) -> None:
    b = base
    print()
    print(f"Baseline (the same windows with --baseline's flags): mean {b['baseline_mean']:.3f}, "
          f"worst {b['baseline_worst']:.3f}, {b['baseline_below_floor']} of "
          f"{b['baseline_runs']} runs below the floor, worst max/mean requests "
          f"{b['baseline_worst_skew']:.2f}, TTFT p50 {b['baseline_ttft_p50_s']:.2f} s.")  # fmt: skip
    print(f"This sweep - baseline, paired by window: {b['diff_points']:+.2f} +- "
          f"{b['diff_se']:.2f} points of the capacity-aware ceiling (ahead in "
          f"{b['windows_ahead']} windows, behind in {b['windows_behind']}); TTFT p50 "
          f"x{b['ttft_ratio']:.3f} (geometric mean of the windows' ratios).")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
