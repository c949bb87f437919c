"""``prefixmesh tune``: search the engine knobs on the client's own workload, against an SLO.

Each point of the search (loadtest/tune_search.py) is measured for real: ``LocalCluster`` starts
Redis, ``--replicas`` replicas on the real model with the point's flags and a router, the load
tester replays the workload window (a trace, or ``--limit`` requests of one), and the result is
read back from its summary plus each replica's ``Replica.GetStats`` (preemptions, recomputed
tokens). Prints a table of every point, writes a Pareto plot and prints the pick as a ready
``prefixmesh replica`` command line with one sentence per knob.

```bash
prefixmesh tune --trace loadtest/data/sample_trace.jsonl --limit 120 --budget 20m \
    --slo-ttft-p99 2000 --slo-itl-p99 200 --out tune-results
```
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadtest.local_cluster import (
    LocalCluster,
    add_cluster_flags,
    add_window_flags,
    loadtest_argv,
    logs_under,
)
from loadtest.tune_search import Measurement, PercentileSlo, Point, Search

FLAGS = {"max_num_batched_tokens": "--max-num-batched-tokens", "max_num_seqs": "--max-num-seqs",
         "kv_cache_gb": "--kv-cache-gb"}  # fmt: skip
WHY = {
    "max_num_batched_tokens": "the step's token budget, and so the prefill chunk: larger gives "
    "long prompts faster first tokens, smaller keeps decoding streams smooth",
    "max_num_seqs": "sequences in flight: more raises throughput until the pool preempts",
    "kv_cache_gb": "the KV pool: more holds more prefixes and sequences (fewer preemptions, more "
    "hits), at the cost of memory for activations",
}


def replica_flags(point: Point) -> list[str]:
    return [f"{FLAGS[k]}={getattr(point, k)}" for k in FLAGS]


def command_line(point: Point, replicas: int) -> str:
    """The pick as a ready command: ``prefixmesh replica`` flags, or ``up`` with ``--replicas``."""
    if replicas <= 1:
        return shlex.join(["prefixmesh", "replica", *replica_flags(point)])
    args = ["prefixmesh", "up", "--replicas", str(replicas), "--policy", point.policy]
    return shlex.join([*args, *(f"--replica-arg={f}" for f in replica_flags(point))])


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*(m|s|)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use 20m, 90s or 90")
    return float(m.group(1)) * (60 if m.group(2) == "m" else 1)


class RealRunner:
    """Measures a point on real replicas that it starts (and stops) itself."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out

    def measure(self, point: Point, limit_s: float) -> Measurement:
        t0 = time.monotonic()
        a = argparse.Namespace(**vars(self.args))
        a.replica_arg = [*self.args.replica_arg, *replica_flags(point)]
        a.policy, a.max_duration = point.policy, max(10.0, limit_s - 60)
        run = self.out / f"point-{abs(hash(point.key())) % 10**8:08d}"
        cluster = LocalCluster(a, logs_under(run))
        try:
            cluster.start()
            extra = tuple(shlex.split(self.args.loadtest_args))
            # A synthetic workload (--workload random / shared-prefix) has no text to send.
            fmt = "token-ids" if "--workload" in extra else "text"
            argv = loadtest_argv(
                a, cluster.router_grpc, cluster.router_grpc, run, prompt_format=fmt, extra=extra
            )
            done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s)
            if done.returncode:
                raise RuntimeError(done.stderr[-400:])
            summary = json.loads((run / "summary.json").read_text())
            preempt = _replica_counters(cluster.router_grpc)
        except Exception as exc:  # a knob the replica refused, a crash, the budget
            return Measurement(point, 0, 0, None, None, None, None, error=str(exc)[-300:],
                               seconds=time.monotonic() - t0)  # fmt: skip
        finally:
            cluster.stop()
        return from_summary(point, summary, preempt, time.monotonic() - t0)


def _replica_counters(router: str) -> dict[str, int]:
    """Preemptions and recomputed tokens summed over the replicas (fresh, so since start)."""
    import grpc

    from proto import prefixmesh_pb2 as pb
    from proto import prefixmesh_pb2_grpc as pb_grpc

    with grpc.insecure_channel(router) as ch:
        state = pb_grpc.ClusterStub(ch).ListReplicas(pb.Empty(), timeout=10)
    total = {"preemptions": 0, "recomputed_tokens": 0}
    for r in state.replicas:
        with grpc.insecure_channel(r.address) as ch:
            s = pb_grpc.ReplicaStub(ch).GetStats(pb.Empty(), timeout=10)
        total["preemptions"] += s.recompute_preemptions + s.swap_preemptions
        total["recomputed_tokens"] += s.recomputed_tokens
    return total


def from_summary(point: Point, s: dict, preempt: dict[str, int], seconds: float) -> Measurement:
    """A measurement from the load tester's summary.json (its goodput uses its --slo)."""
    lat = s["latency_ms"]
    good = s.get("goodput", {}).get("requests_per_s", s["throughput"]["requests_per_s"])
    return Measurement(
        point, s["throughput"]["requests_per_s"], good, lat["ttft"]["p90"], lat["ttft"]["p99"],
        lat["itl"]["p90"], lat["itl"]["p99"], s.get("hit_rate"), preempt["preemptions"],
        preempt["recomputed_tokens"], s["throughput"]["output_tokens_per_s"], seconds,
    )  # fmt: skip


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def table(search: Search, best: Measurement | None) -> str:
    head = ("| point | req/s | goodput req/s | TTFT p90/p99 ms | ITL p90/p99 ms | hit rate | "
            "preemptions | recomputed tokens | SLO |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    rows = [head]
    for m in search.measured.values():
        p = " ".join(replica_flags(m.point)) + ("" if m.point.policy == "cache_aware" else
                                                f" policy={m.point.policy}")  # fmt: skip
        star = " **(pick)**" if best is m else (" (defaults)" if m.point == Point() else "")
        hit = "-" if m.hit_rate is None else f"{100 * m.hit_rate:.1f}%"
        slo = "error: " + m.error[:40] if m.error else ("met" if search.slo.met(m) else "missed")
        rows.append(f"| {p}{star} | {m.throughput_rps:.3f} | {m.goodput_rps:.3f} | "
                    f"{_ms(m.ttft_p90)}/{_ms(m.ttft_p99)} | {_ms(m.itl_p90)}/{_ms(m.itl_p99)} | "
                    f"{hit} | {m.preemptions} | {m.recomputed_tokens} | {slo} |")  # fmt: skip
    return "\n".join(rows)


def pareto_plot(search: Search, best: Measurement | None, path: Path) -> None:
    """Throughput against TTFT p99, the Pareto front joined, the SLO's TTFT p99 as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [m for m in search.measured.values() if not m.error and m.ttft_p99 is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([m.ttft_p99 for m in ms], [m.throughput_rps for m in ms], label="measured")
    front, top = [], -1.0
    for m in sorted(ms, key=lambda m: m.ttft_p99):  # no point is faster and serves more
        if m.throughput_rps > top:
            front.append(m)
            top = m.throughput_rps
    ax.plot([m.ttft_p99 for m in front], [m.throughput_rps for m in front], "--", label="Pareto")
    if best is not None and best.ttft_p99 is not None:
        ax.scatter([best.ttft_p99], [best.throughput_rps], marker="*", s=250, label="pick")
    if search.slo.ttft_p99 is not None:
        ax.axvline(search.slo.ttft_p99, color="red", label="SLO TTFT p99")
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("throughput (req/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixmesh tune", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    add_cluster_flags(p)
    add_window_flags(p, limit=120)
    p.set_defaults(replicas=1, trace=Path(__file__).parent / "data" / "sample_trace.jsonl")
    p.add_argument("--budget", type=_seconds, default=_seconds("20m"), help="e.g. 20m or 300s")
    for name in ("ttft_p90", "ttft_p99", "itl_p90", "itl_p99"):
        flag = "--slo-" + name.replace("_", "-")
        p.add_argument(flag, type=float, default=None, help=f"SLO target, ms: {name}")
    p.add_argument("--slo", default="", help="the load tester's per-request goodput SLO "
                   "(default: ttft and tpot from --slo-ttft-p99 / --slo-itl-p99)")  # fmt: skip
    p.add_argument("--loadtest-args", default="", help="more load tester flags (synthetic "
                   "workloads: '--workload synthetic --prompt-len 1024 --output-len 256')")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("tune-results"),
                   help="folder: results.jsonl (resumed from), tune.md, pareto.png")  # fmt: skip
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a SIGTERM stops the cluster too (RealRunner's finally)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    slo = PercentileSlo(args.slo_ttft_p90, args.slo_ttft_p99, args.slo_itl_p90, args.slo_itl_p99)
    per_request = args.slo or ",".join(
        f"{k}={v}ms" for k, v in (("ttft", slo.ttft_p99), ("tpot", slo.itl_p99)) if v
    )
    if per_request:
        args.loadtest_args = f"{args.loadtest_args} --slo {per_request}"
    args.out.mkdir(parents=True, exist_ok=True)
    knobs = ("max_num_batched_tokens", "max_num_seqs", "kv_cache_gb")
    search = Search(RealRunner(args, args.out), slo, args.budget, args.out / "results.jsonl",
                    knobs=knobs + (("policy",) if args.replicas > 1 else ()),
                    progress=lambda msg: print(msg, flush=True))  # fmt: skip
    try:
        best = search.run()
    except KeyboardInterrupt:  # what was measured is in results.jsonl: a rerun resumes from it
        print(f"interrupted: {len(search.measured)} points kept in {search.results}")
        best = search.best()
    text = table(search, best)
    (args.out / "tune.md").write_text(text + "\n")
    pareto_plot(search, best, args.out / "pareto.png")
    print(text)
    if best is None:
        print("nothing measured within the budget", file=sys.stderr)
        return 1
    print(f"\nrecommended ({'meets' if slo.met(best) else 'MISSES'} the SLO):")
    print(command_line(best.point, args.replicas))
    for k in FLAGS:
        print(f"  {FLAGS[k]}={getattr(best.point, k)}: {WHY[k]}.")
    return 0
