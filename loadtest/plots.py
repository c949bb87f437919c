"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.report import cluster_hit_rate, replica_rows  # noqa: E402
from loadtest.request import RequestResult  # noqa: E402

_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end"))


def _finish_axes(ax: Any, legend: bool) -> None:
    ax.grid(alpha=0.3)
    if legend:
        ax.legend()


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf(ax: Any, values_s: list[float], label: str | None = None) -> None:
    if not values_s:
        return
    xs = np.sort(np.array(values_s)) * 1e3
    ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)


def _ok(results: list[RequestResult]) -> list[RequestResult]:
    return [r for r in results if r.ok and not r.warmup]


def plot_latency_cdfs(runs: dict[str, list[RequestResult]], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (attr, title) in zip(axes, _METRICS, strict=True):
        for name, results in runs.items():
            values = [v for r in _ok(results) if (v := getattr(r, attr)) is not None]
            _cdf(ax, values, name)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        _finish_axes(ax, legend=len(runs) > 1)
    _save(fig, path)


def plot_hit_rates(summaries: dict[str, dict[str, Any]], path: Path) -> None:
    """Per-replica hit rate bars, one cluster of bars per run, both ceilings as lines."""
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(summaries))
    replicas = sorted({rid for s in summaries.values() for rid in replica_rows(s)})
    xs = np.arange(len(replicas) + 1)
    for i, (name, s) in enumerate(summaries.items()):
        rows = replica_rows(s)
        heights = [(rows.get(rid, {}).get("hit_rate") or 0.0) for rid in replicas]
        heights.append(cluster_hit_rate(s) or 0.0)
        ax.bar(xs + i * width, heights, width, label=name)
    best = next(
        (s.get("best_hit_rate") for s in summaries.values() if s.get("best_hit_rate")), None
    )
    if best is not None:
        ax.axhline(best, color="k", linestyle="--", label="ceiling: unlimited cache")
    capacity = next(
        (
            s["ceilings"]["capacity_aware"]
            for s in summaries.values()
            if s.get("ceilings", {}).get("capacity_aware") is not None
        ),
        None,
    )
    if capacity is not None:
        ax.axhline(capacity, color="tab:red", linestyle=":", label="ceiling: capacity-aware")
    ax.set_xticks(xs + width * (len(summaries) - 1) / 2, [*replicas, "cluster"], rotation=20)
    ax.set_ylabel("prefix hit rate")
    ax.set_ylim(0, 1)
    ax.legend()
    _save(fig, path)


def plot_throughput(runs: dict[str, list[RequestResult]], path: Path) -> None:
    """Completed requests and output tokens per second over the run (about 40 bins)."""
    spans = [
        max(r.end_time for r in ok) - min(r.send_time for r in ok)
        for ok in map(_ok, runs.values())
        if ok
    ]
    bin_s = float(np.clip(max(spans, default=1.0) / 40, 0.05, 10.0))
    fig, (ax_req, ax_tok) = plt.subplots(1, 2, figsize=(12, 4))
    for name, results in runs.items():
        ok = _ok(results)
        if not ok:
            continue
        start = min(r.send_time for r in ok)
        ends = np.array([r.end_time - start for r in ok])
        edges = np.arange(0.0, ends.max() + bin_s, bin_s)
        if edges.size < 2:
            edges = np.array([0.0, bin_s])
        reqs, _ = np.histogram(ends, edges)
        toks, _ = np.histogram(ends, edges, weights=[r.output_tokens for r in ok])
        ax_req.stairs(reqs / bin_s, edges, label=name)
        ax_tok.stairs(toks / bin_s, edges, label=name)
    ax_req.set_title("completed requests/s")
    ax_tok.set_title("output tokens/s")
    for ax in (ax_req, ax_tok):
        ax.set_xlabel(f"s since first request ({bin_s:.2g} s bins)")
        ax.set_ylim(bottom=0)
        _finish_axes(ax, legend=len(runs) > 1)
    _save(fig, path)


def write_plots(
    runs: dict[str, list[RequestResult]], summaries: dict[str, dict[str, Any]], out_dir: Path
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "latency_cdf.png", out_dir / "hit_rate.png", out_dir / "throughput.png"]
    plot_latency_cdfs(runs, paths[0])
    plot_hit_rates(summaries, paths[1])
    plot_throughput(runs, paths[2])
    return paths
