"""Readable terminal tables (rich) for one run and for a side-by-side policy comparison."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _num(v: float | None, fmt: str = ",.2f") -> str:
    return "-" if v is None else format(v, fmt)


def replica_rows(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-replica counters: the router's deltas when known, else the responses' usage."""
    cluster = summary.get("cluster")
    return cluster["replicas"] if cluster else summary["per_replica"]


def cluster_hit_rate(summary: dict[str, Any]) -> float | None:
    cluster = summary.get("cluster")
    if cluster and cluster.get("hit_rate") is not None:
        return cluster["hit_rate"]
    return summary["hit_rate"]


def ceiling_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The three ceilings and the achieved rate as a fraction of each (loadtest/ceilings.py)."""
    c = summary.get("ceilings")
    if not c:
        best = summary.get("best_hit_rate")
        return [] if best is None else [("best possible", f"{pct(best)} (unlimited cache)")]
    rows = [
        (
            "ceiling: unlimited cache",
            f"{pct(c['unlimited'])} (achieved {pct(c['fraction_of_unlimited'])} of it, "
            f"block {c['block_size']})",
        )
    ]
    if c.get("capacity_aware") is not None:
        rows.append(
            (
                "ceiling: capacity-aware",
                f"{pct(c['capacity_aware'])} (one LRU of {c['capacity_blocks']:,} blocks; "
                f"achieved {pct(c['fraction_of_capacity_aware'])} of it)",
            )
        )
    else:
        rows.append(("ceiling: capacity-aware", "- (the replicas' KV pool sizes are unknown)"))
    if c.get("belady") is not None:
        rows.append(
            (
                "ceiling: offline-optimal",
                f"{pct(c['belady'])} (Belady's MIN under the prefix rule, same blocks; achieved "
                f"{pct(c.get('fraction_of_belady'))} of it)",
            )
        )
    return rows


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    req = summary["requests"]
    head = Table(title=summary.get("name", "loadtest"), show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("requests", f"{req['ok']} ok / {req['sent']} sent ({req['warmup']} warm-up)")
    if req["failed"] or req["not_sent"]:
        head.add_row("errors", ", ".join(f"{k}: {v}" for k, v in req["by_status"].items()))
        head.add_row("not sent", str(req["not_sent"]))
        for status, message in req["error_samples"].items():
            head.add_row(f"  {status}", message[:160])
    if req["wrong_output_length"]:
        head.add_row("wrong output length", str(req["wrong_output_length"]))
    tp = summary["throughput"]
    head.add_row("duration", f"{summary['duration_s']:.2f} s")
    head.add_row(
        "throughput",
        f"{tp['requests_per_s']:.2f} req/s, "
        f"{tp['output_tokens_per_s']:,.1f} output tok/s, "
        f"{tp['total_tokens_per_s']:,.1f} total tok/s",
    )
    if "goodput" in summary:
        g = summary["goodput"]
        head.add_row(
            "goodput", f"{g['requests_per_s']:.2f} req/s ({pct(g['fraction'])} meet {g['slo']})"
        )
    head.add_row("prefix hit rate", pct(cluster_hit_rate(summary)))
    if pre := (summary.get("cluster") or {}).get("preemption"):  # issue 53: the replicas' own
        head.add_row("preemptions", preemption_line(pre))
    for label, value in ceiling_rows(summary):
        head.add_row(label, value)
    lag = summary["send_lag_ms"]
    if lag["count"]:
        head.add_row("send lag", f"p50 {_ms(lag['p50'])} ms, p99 {_ms(lag['p99'])} ms")
    console.print(head)

    lat = Table(title="latency (ms)")
    for col in ("metric", "mean", "p50", "p90", "p99", "max"):
        lat.add_column(col, justify="right" if col != "metric" else "left")
    for name, s in summary["latency_ms"].items():
        lat.add_row(name, *(_ms(s[k]) for k in ("mean", "p50", "p90", "p99", "max")))
    console.print(lat)

    reps = Table(title="replicas")
    for col in ("replica", "requests", "prompt tokens", "cached tokens", "hit rate"):
        reps.add_column(col, justify="right" if col != "replica" else "left")
    for rid, r in replica_rows(summary).items():
        reps.add_row(
            rid,
            str(r["requests"]),
            f"{r['prompt_tokens']:,}",
            f"{r['cached_tokens']:,}",
            pct(r["hit_rate"]),
        )
    console.print(reps)
    cluster = summary.get("cluster")
    if cluster and cluster["decisions"]:
        decisions = ", ".join(f"{k}: {v}" for k, v in cluster["decisions"].items())
        console.print(f"routing decisions ({cluster['policy']}): {decisions}")
    if cluster and cluster.get("misses", {}).get("cacheable"):
        console.print(f"prompt blocks (router's attribution): {misses_line(cluster['misses'])}")


def preemption_line(p: dict[str, float]) -> str:
    """Recompute / swap preemptions, recomputed tokens, swap traffic and mean queue time."""
    queue = p["queue_time_s"] / p["admissions"] if p.get("admissions") else None
    return (f"{p['recompute_preemptions']:.0f} recompute, {p['swap_preemptions']:.0f} swap; "
            f"{p['recomputed_tokens']:,.0f} tokens recomputed; {p['swapped_out_blocks']:.0f} blocks "
            f"out / {p['swapped_in_blocks']:.0f} in; queue {_ms(None if queue is None else 1e3 * queue)} ms "
            "mean")  # fmt: skip


def misses_line(misses: dict[str, int]) -> str:
    """``hit 120 (40%), compulsory 90 (30%), ...`` over the cacheable prompt blocks."""
    total = misses.get("cacheable", 0)
    parts = []
    for kind in ("hit", "compulsory", "evicted", "elsewhere", "stale"):
        n = misses.get(kind, 0)
        parts.append(f"{kind} {n:,} ({pct(n / total if total else None)})")
    return ", ".join(parts)


COMPARE_ROWS: list[tuple[str, Any]] = [
    ("ok / sent", lambda s: f"{s['requests']['ok']} / {s['requests']['sent']}"),
    ("prefix hit rate", lambda s: pct(cluster_hit_rate(s))),
    ("ceiling: unlimited cache", lambda s: pct(s.get("best_hit_rate"))),
    ("ceiling: capacity-aware", lambda s: pct(s.get("ceilings", {}).get("capacity_aware"))),
    (
        "achieved / capacity-aware",
        lambda s: pct(s.get("ceilings", {}).get("fraction_of_capacity_aware")),
    ),
    ("ceiling: offline-optimal", lambda s: pct(s.get("ceilings", {}).get("belady"))),
    ("achieved / offline-optimal", lambda s: pct(s.get("ceilings", {}).get("fraction_of_belady"))),
    ("TTFT mean (ms)", lambda s: _ms(s["latency_ms"]["ttft"]["mean"])),
    ("TTFT p50 (ms)", lambda s: _ms(s["latency_ms"]["ttft"]["p50"])),
    ("TTFT p90 (ms)", lambda s: _ms(s["latency_ms"]["ttft"]["p90"])),
    ("TTFT p99 (ms)", lambda s: _ms(s["latency_ms"]["ttft"]["p99"])),
    ("TPOT p50 (ms)", lambda s: _ms(s["latency_ms"]["tpot"]["p50"])),
    ("TPOT p99 (ms)", lambda s: _ms(s["latency_ms"]["tpot"]["p99"])),
    ("E2E p50 (ms)", lambda s: _ms(s["latency_ms"]["e2e"]["p50"])),
    ("E2E p99 (ms)", lambda s: _ms(s["latency_ms"]["e2e"]["p99"])),
    ("requests/s", lambda s: _num(s["throughput"]["requests_per_s"])),
    ("output tok/s", lambda s: _num(s["throughput"]["output_tokens_per_s"], ",.1f")),
    ("goodput req/s", lambda s: _num(s.get("goodput", {}).get("requests_per_s"))),
    *(
        (
            f"blocks: {kind}",
            lambda s, kind=kind: _share(s.get("cluster", {}).get("misses", {}), kind),
        )
        for kind in ("hit", "compulsory", "evicted", "elsewhere", "stale")
    ),
    (
        "requests per replica",
        lambda s: " ".join(str(r["requests"]) for r in replica_rows(s).values()),
    ),
    (
        "hit rate per replica",
        lambda s: " ".join(pct(r["hit_rate"]) for r in replica_rows(s).values()),
    ),
]


def _share(misses: dict[str, int], kind: str) -> str:
    total = misses.get("cacheable", 0)
    return f"{misses.get(kind, 0):,} ({pct(misses.get(kind, 0) / total)})" if total else "-"


def print_comparison(summaries: dict[str, dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="policy comparison (same workload)")
    table.add_column("metric")
    for policy in summaries:
        table.add_column(policy, justify="right")
    for label, fn in COMPARE_ROWS:
        table.add_row(label, *(fn(s) for s in summaries.values()))
    console.print(table)
