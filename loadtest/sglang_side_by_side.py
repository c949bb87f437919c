"""Our router against sglang-router, on the same replicas and the same text workload.

``python -m loadtest.sglang_side_by_side --sglang-python /tmp/sgl-venv/bin/python`` starts
Redis, ``--replicas`` replicas (each with an OpenAI HTTP port) and our router (gRPC + HTTP),
then, for each router in ``--order``, replays the same trace requests as text prompts
(``prefixmesh loadtest --prompt-format text``, a closed loop, or the trace's own arrival times
with ``--arrival trace``) through that router's OpenAI HTTP door: sglang-router (``python -m
sglang_router.launch_router --policy cache_aware`` in front of the replicas' HTTP ports, from
the virtual environment of ``--sglang-python``; none of it is a project dependency) or ours.
Hit rates come from the replicas' own usage (``prompt_tokens_details.cached_tokens``), so they
compare across routers.

Every run starts cold: each sends a fresh ``cache_salt`` (the load tester's default), and
blocks of different salts never match, while the earlier run's blocks, all older, are the
first the replicas' LRU evicts. sglang-router starts fresh for its run (an empty tree); with or
without the salt (it may drop the field), its prompts match no block of the other run.

Results: ``--out/<router>/`` (the load tester's files) and ``--out/side_by_side.json``; a
markdown table is printed, then how many requests the hit rates differ on (``differing``): both
routers replay the same requests, so request by request their cached tokens say whether a gap
is spread over the workload or made by a few returning conversations whose prefix survived
eviction under one placement and not the other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from loadtest.local_cluster import (
    ROOT,
    LocalCluster,
    above_replicas,
    add_cluster_flags,
    add_window_flags,
    loadtest_argv,
    logs_under,
    run_order,
    wait_http,
)
from loadtest.results import read_requests
from prefixmesh.ports import free_ports

ROUTERS = ("sglang", "prefixmesh")


def _start_sglang(
    args: argparse.Namespace, cluster: LocalCluster, logs: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port, metrics_port = free_ports(2)
    argv = [
        args.sglang_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port), "--policy", args.sglang_policy,
        "--worker-urls", *cluster.replica_http,
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=(logs / "sglang-router.log").open("wb"), stderr=subprocess.STDOUT,
        preexec_fn=above_replicas,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http([f"{url}/health"], [proc], 120.0)
    return proc, url


def _loadtest(args: argparse.Namespace, target: str, cluster: str, out: Path) -> dict:
    subprocess.run(loadtest_argv(args, target, cluster, out), cwd=ROOT, check=True)
    return json.loads((out / "summary.json").read_text())


def row(name: str, s: dict) -> dict:
    lat = s["latency_ms"]
    cl = s.get("cluster") or {}
    return {
        "router": name,
        "requests_ok": s["requests"]["ok"],
        "failed": s["requests"]["failed"],
        "hit_rate": s["hit_rate"],
        # Of the cached tokens, those a peer replica sent (a fetch); sglang-router sends no
        # fetch hint, so its replicas fetch nothing.
        "fetched_tokens": s["tokens"].get("fetched", 0),
        "ttft_p50_ms": lat["ttft"]["p50"],
        "ttft_p90_ms": lat["ttft"]["p90"],
        "e2e_p50_ms": lat["e2e"]["p50"],
        "e2e_p90_ms": lat["e2e"]["p90"],
        "requests_per_s": s["throughput"]["requests_per_s"],
        "per_replica_requests": {k: v["requests"] for k, v in s["per_replica"].items()},
        "per_replica_hit_rate": {k: v["hit_rate"] for k, v in s["per_replica"].items()},
        "misses": cl.get("misses"),
        "ceilings": s.get("ceilings"),
    }


def markdown(rows: list[dict]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v / 1000:.2f} s"

    lines = [
        "| router | ok | hit rate | fetched tokens | TTFT p50 | TTFT p90 | e2e p50 | e2e p90 "
        "| req/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        lines.append(
            f"| {r['router']} | {r['requests_ok']} | {hit} | {r['fetched_tokens']:,} | "
            f"{ms(r['ttft_p50_ms'])} | {ms(r['ttft_p90_ms'])} | {ms(r['e2e_p50_ms'])} | "
            f"{ms(r['e2e_p90_ms'])} | {r['requests_per_s']:.2f} |"
        )
    return "\n".join(lines)


def differing(a: list[dict], b: list[dict]) -> dict:
    """Requests (the load tester's ``requests.jsonl`` rows, matched by index) whose cached
    tokens differ between two runs of the same workload: how many, the net difference (a's
    cached tokens less b's) and the share of the absolute difference that the five largest
    carry."""
    cached_b = {r["index"]: r.get("cached_tokens") or 0 for r in b}
    gaps = sorted(
        (
            (r.get("cached_tokens") or 0) - cached_b[r["index"]]
            for r in a
            if r["index"] in cached_b and (r.get("cached_tokens") or 0) != cached_b[r["index"]]
        ),
        key=abs,
        reverse=True,
    )
    total = sum(abs(g) for g in gaps)
    return {
        "requests": len(cached_b.keys() & {r["index"] for r in a}),
        "differ": len(gaps),
        "net_cached_tokens": sum(gaps),
        "top5_share": sum(abs(g) for g in gaps[:5]) / total if total else 0.0,
    }


def compare_runs(out: Path, order: list[str]) -> str:
    """``differing`` over the two routers' ``requests.jsonl`` under ``out``, written to
    ``out/differing.json``; returns the line to print."""
    first, second = (read_requests(out / name / "requests.jsonl") for name in order)
    d = differing(first, second)
    (out / "differing.json").write_text(json.dumps(d, indent=2))
    return (
        f"cached tokens differ on {d['differ']} of {d['requests']} requests "
        f"({order[0]} less {order[1]}: {d['net_cached_tokens']:+,} tokens; the five "
        f"largest differences carry {100 * d['top5_share']:.0f}% of them)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.sglang_side_by_side",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sglang-python", default="/tmp/sgl-venv/bin/python",
                   help="python of a virtual environment with sglang-router installed")  # fmt: skip
    p.add_argument("--sglang-policy", default="cache_aware")
    p.add_argument("--order", default="sglang,prefixmesh", help="routers, in run order")
    add_cluster_flags(p)
    add_window_flags(p)
    p.add_argument("--out", type=Path, default=Path("loadtest-results/sglang-side-by-side"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        order = run_order(args.order, ROUTERS)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    logs = logs_under(args.out)
    cluster = LocalCluster(args, logs)
    rows: list[dict] = []
    try:
        cluster.start()
        for name in order:
            if name == "sglang":
                proc, url = _start_sglang(args, cluster, logs)
                try:
                    summary = _loadtest(args, url, "none", args.out / name)
                finally:
                    proc.terminate()
                    proc.wait(30)
            else:
                summary = _loadtest(args, cluster.router_http, cluster.router_grpc, args.out / name)
            rows.append(row(name, summary))
    finally:
        cluster.stop()
    (args.out / "side_by_side.json").write_text(json.dumps(rows, indent=2))
    print(markdown(rows))
    if len(order) == 2:
        print(compare_runs(args.out, order))
    return 0


if __name__ == "__main__":
    sys.exit(main())
