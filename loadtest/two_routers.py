"""One router against two on one Redis, with clients alternating between the two.

``python -m loadtest.two_routers`` starts Redis, ``--replicas`` replicas and two routers on
that Redis (``loadtest.local_cluster``), then replays one trace window once per mode in
``--order``:

- ``one``: one load tester sends the whole window to router 0;
- ``two``: two load testers at once, with one cache salt, send requests 0, 2, 4, ... to
  router 0 and 1, 3, 5, ... to router 1 (``prefixmesh loadtest --shard K/2``), each request at
  its time in the window (``--arrival trace``) or as half of the closed loop's workers.

Every mode starts cold: it sends a fresh cache salt, blocks of different salts never match, and
the earlier mode's blocks, all older, are the first the replicas' LRU evicts. A mode's cluster
hit rate is its cached over its prompt tokens, from the replicas' own usage; the table also
gives it against the window's capacity-aware ceiling, each router's own hit rate, requests per
replica with their max/mean, and the TTFT p50. Routers share what replicas hold through Redis,
and each other's routing decisions (predicted blocks, in-flight tokens) through Redis too, so
two routers should keep what one keeps (issue 16 asks for within 2 points).

Token-id prompts over gRPC by default (``--prompt-format text`` sends text to the routers'
HTTP doors). Results: ``--out/<mode>/`` (the load testers' files; ``two/router-K/``) and
``--out/two_routers.json``; a markdown table is printed.

```bash
python -m loadtest.two_routers --limit 1000                          # closed loop of 8
python -m loadtest.two_routers --limit 300 --arrival trace           # the trace's arrivals
```
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

from loadtest.ceilings import ceilings_summary
from loadtest.cli import build_parser as loadtest_parser
from loadtest.local_cluster import (
    ROOT,
    LocalCluster,
    add_cluster_flags,
    add_window_flags,
    loadtest_argv,
    logs_under,
    run_order,
)
from loadtest.results import read_requests
from loadtest.workload import build_workload

MODES = ("one", "two")


def combine(runs: list[list[dict]], replicas: int) -> dict:
    """One mode's numbers from its load testers' request rows (``requests.jsonl``, one list per
    router): the cluster hit rate over every served request, each router's, requests per
    replica and their max/mean (over ``replicas``, so an idle replica counts), TTFT p50 (s)."""
    served = [[r for r in rows if r.get("status") == "OK"] for rows in runs]
    every = [r for rows in served for r in rows]

    def hit_rate(rows: list[dict]) -> float:
        prompt = sum(r["prompt_tokens"] for r in rows)
        return sum(r.get("cached_tokens") or 0 for r in rows) / prompt if prompt else 0.0

    per_replica = Counter(r["replica_id"] for r in every)
    mean = len(every) / replicas if replicas else 0.0
    return {
        "requests_ok": len(every),
        "failed": sum(len(rows) for rows in runs) - len(every),
        "prompt_tokens": sum(r["prompt_tokens"] for r in every),
        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in every),
        "hit_rate": hit_rate(every),
        "per_router_hit_rate": [hit_rate(rows) for rows in served],
        "per_replica_requests": dict(sorted(per_replica.items())),
        "max_over_mean_requests": max(per_replica.values()) / mean if every else 0.0,
        "ttft_p50_s": statistics.median(r["ttft"] for r in every) if every else 0.0,
    }


def window_ceilings(argv: list[str], block_size: int, capacity_blocks: int | None) -> dict:
    """The unlimited and capacity-aware ceilings of the window a load tester command sends
    (its own workload flags, so both modes are judged against the same window)."""
    args = loadtest_parser().parse_args(argv[4:])  # past ``python -m prefixmesh.cli loadtest``
    args.workload = "trace"
    args.shard = None
    return ceilings_summary(build_workload(args), block_size, capacity_blocks)


def _run_mode(args: argparse.Namespace, cluster: LocalCluster, mode: str) -> tuple[dict, dict]:
    """Replays the window in ``mode``; returns (its ``combine`` numbers, the ceilings)."""
    salt = f"two-routers-{mode}-{uuid.uuid4().hex[:8]}"
    n = 1 if mode == "one" else 2
    procs, outs = [], []
    for k in range(n):
        grpc_address, http = cluster.routers[k]
        out = args.out / mode / (f"router-{k}" if n > 1 else "")
        target = http if args.prompt_format == "text" else grpc_address
        argv = loadtest_argv(
            args, target, grpc_address, out, prompt_format=args.prompt_format,
            concurrency=max(1, args.concurrency // n),
            extra=("--cache-salt", salt, *(("--shard", f"{k}/{n}") if n > 1 else ()),
                   *args.loadtest_arg),
        )  # fmt: skip
        procs.append(subprocess.Popen(argv, cwd=ROOT))
        outs.append(out)
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"the load tester failed ({p.args})")
    numbers = combine([read_requests(o / "requests.jsonl") for o in outs], args.replicas)
    summary = json.loads((outs[0] / "summary.json").read_text())
    capacity = (summary.get("ceilings") or {}).get("capacity_blocks")
    return numbers, window_ceilings(argv, args.block_size, capacity)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| routers | ok | hit rate | of capacity-aware | per router | requests per replica "
        "| max/mean | TTFT p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cap = r.get("capacity_aware")
        of_cap = f"{100 * r['hit_rate'] / cap:.1f}%" if cap else "-"
        routers = " / ".join(f"{100 * h:.1f}%" for h in r["per_router_hit_rate"])
        counts = " / ".join(str(c) for c in r["per_replica_requests"].values())
        lines.append(
            f"| {r['mode']} | {r['requests_ok']} | {100 * r['hit_rate']:.1f}% | {of_cap} | "
            f"{routers} | {counts} | {r['max_over_mean_requests']:.2f} | "
            f"{r['ttft_p50_s']:.2f} s |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.two_routers",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--order", default="one,two", help="modes, in run order")
    add_cluster_flags(p)
    add_window_flags(p)
    p.add_argument(
        "--prompt-format", choices=("token-ids", "text"), default="token-ids",
        help="token ids over the routers' gRPC doors, or text over their HTTP doors",
    )  # fmt: skip
    p.add_argument(
        "--loadtest-arg", action="append", default=[],
        help="extra load tester flag (e.g. --loadtest-arg=--vocab-size=439 for a small model)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("loadtest-results/two-routers"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        order = run_order(args.order, MODES)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    logs = logs_under(args.out)
    cluster = LocalCluster(args, logs, routers=2)
    rows: list[dict] = []
    try:
        cluster.start()
        for mode in order:
            numbers, ceilings = _run_mode(args, cluster, mode)
            rows.append({"mode": mode, **numbers, **_ceiling_fields(ceilings)})
    finally:
        cluster.stop()
    (args.out / "two_routers.json").write_text(json.dumps(rows, indent=2))
    print(markdown(rows))
    by_mode = {r["mode"]: r for r in rows}
    if len(by_mode) == 2:
        gap = 100 * (by_mode["two"]["hit_rate"] - by_mode["one"]["hit_rate"])
        print(f"two routers less one: {gap:+.2f} points of hit rate")
    return 0


def _ceiling_fields(ceilings: dict) -> dict:
    return {
        "unlimited": ceilings.get("unlimited"),
        "capacity_blocks": ceilings.get("capacity_blocks"),
        "capacity_aware": ceilings.get("capacity_aware"),
    }


if __name__ == "__main__":
    sys.exit(main())
