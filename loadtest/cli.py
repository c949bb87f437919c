"""``prefixmesh loadtest``: replay a Mooncake trace or a synthetic workload against a router or
a replica and report latency, throughput, goodput and prefix-cache hit rates."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import uuid
from pathlib import Path

from rich.console import Console

from loadtest.arrivals import ARRIVAL_KINDS
from loadtest.bench import BenchOptions, compare_policies, run_once, save_run
from loadtest.client import ClientError
from loadtest.clients import PROTOCOLS, make_client, protocol_of
from loadtest.cluster import ClusterClient
from loadtest.report import print_comparison, print_summary
from loadtest.runner import RunLimits
from loadtest.slo import parse_slo
from loadtest.tokens import DEFAULT_MIN_TOKEN_ID, DEFAULT_VOCAB_SIZE
from loadtest.workload import (
    PROMPT_FORMATS,
    SAMPLE_TRACE,
    WORKLOADS,
    build_workload,
    parse_shard,
)
from prefixmesh import event_loop, tls


def _target_flags(p: argparse.ArgumentParser) -> None:
    """Where to send requests and how."""
    g = p.add_argument_group("target")
    g.add_argument(
        "--target",
        default="127.0.0.1:50050",
        help="router or replica: a gRPC host:port (50050: the router of prefixmesh up), or an "
        "http:// or https:// base URL for OpenAI HTTP (POST /v1/completions, streamed)",
    )
    g.add_argument(
        "--protocol",
        default=None,
        choices=PROTOCOLS,
        help="client protocol (default: http for an http(s):// target, else grpc)",
    )
    g.add_argument(
        "--channels", type=int, default=1, help="gRPC channels (connections) in the pool"
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="API key of the target, router or replica (env PREFIXMESH_API_KEY): HTTP "
        "'Authorization: Bearer', gRPC metadata (also for --cluster)",
    )
    tls.add_client_flags(g)  # every target: gRPC, https:// and --cluster (prefixmesh/tls.py)
    g.add_argument(
        "--model",
        default=None,
        help="HTTP: the body's model (default: the first of GET /v1/models)",
    )
    g.add_argument(
        "--cluster",
        default=None,
        help="router gRPC address for Cluster stats and --compare (default: --target for gRPC "
        "targets, none for HTTP ones; 'none' to skip)",
    )
    g.add_argument(
        "--compare",
        default=None,
        help="comma-separated router policies to run in turn, e.g. "
        "cache_aware,round_robin,least_loaded",
    )
    g.add_argument(
        "--cache-salt",
        default="auto",
        help="cache_salt sent with every request; 'auto': a fresh one per run, so caches warmed "
        "by earlier runs do not inflate the hit rate; '' for none",
    )


def _workload_flags(p: argparse.ArgumentParser) -> None:
    """What to send: a trace or a synthetic workload."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="default: trace if --trace is given, else shared-prefix",
    )
    g.add_argument(
        "--trace",
        type=Path,
        default=None,
        help=f"Mooncake JSONL trace (default with --workload trace: {SAMPLE_TRACE.name})",
    )
    g.add_argument(
        "--tokens-per-hash-id",
        type=int,
        default=16,
        help="tokens each 512-token trace block shrinks to",
    )
    g.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default="token-ids",
        help="trace: send token ids, or text with one fixed sentence of --tokens-per-hash-id "
        "tokens per hash id (for routers that match text, e.g. sglang-router)",
    )
    g.add_argument("--trace-start", type=float, default=0.0, help="trace window start (trace s)")
    g.add_argument("--trace-window", type=float, default=None, help="trace window length (trace s)")
    g.add_argument("--limit", type=int, default=None, help="at most this many requests")
    g.add_argument(
        "--shard",
        type=parse_shard,
        default=None,
        metavar="K/N",
        help="send only requests K, K+N, K+2N, ... of the workload (0 <= K < N), at their "
        "times in the whole workload: N load testers, one per router, replay one workload "
        "with clients alternating between the routers",
    )
    g.add_argument("--max-output-tokens", type=int, default=None, help="cap on output lengths")
    g.add_argument("--max-input-tokens", type=int, default=None, help="cap on prompt lengths")
    g.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups")
    g.add_argument(
        "--prompts-per-group", type=int, default=16, help="shared-prefix: conversations per group"
    )
    g.add_argument("--system-prompt-len", type=int, default=512, help="shared-prefix: tokens")
    g.add_argument("--question-len", type=int, default=64, help="shared-prefix: tokens")
    g.add_argument(
        "--zipf",
        type=float,
        default=0.0,
        help="shared-prefix: Zipf exponent of group popularity (0: equal groups)",
    )
    g.add_argument("--turns", type=int, default=1, help="shared-prefix: turns per conversation")
    g.add_argument("--num-requests", type=int, default=100, help="random: requests")
    g.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: length spread")
    g.add_argument("--output-len", type=int, default=32, help="synthetic: output tokens")
    g.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="token ids are drawn below this"
    )
    g.add_argument(
        "--min-token-id",
        type=int,
        default=DEFAULT_MIN_TOKEN_ID,
        help="token ids are drawn from this up (skips special tokens)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed")


def _arrival_flags(p: argparse.ArgumentParser) -> None:
    """When to send it, and how long a run may take."""
    g = p.add_argument_group("arrivals and bounds")
    g.add_argument(
        "--arrival",
        choices=ARRIVAL_KINDS,
        default=None,
        help="default: trace for trace workloads, else poisson",
    )
    g.add_argument(
        "--rate", type=float, default=10.0, help="poisson/gamma: requests/s (inf: all at once)"
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = poisson)")
    g.add_argument(
        "--speedup", type=float, default=1.0, help="trace: replay this many times faster"
    )
    g.add_argument("--concurrency", type=int, default=8, help="closed loop: workers")
    g.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="the first N requests are sent first and left out of the results",
    )
    g.add_argument(
        "--max-duration", type=float, default=600.0, help="no request is sent later than this (s)"
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="then wait at most this long for running requests (s)",
    )
    g.add_argument("--request-timeout", type=float, default=300.0, help="per-request deadline (s)")


def _result_flags(p: argparse.ArgumentParser) -> None:
    """What to report and where."""
    g = p.add_argument_group("results")
    g.add_argument(
        "--out", type=Path, default=None, help="output folder (default: loadtest-results/<time>)"
    )
    g.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft=500ms,tpot=50ms,e2e=10s")
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="block size for the best possible hit rate (default: the replicas')",
    )
    g.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="KV blocks of the whole cluster for the capacity-aware ceiling (default: the "
        "replicas' pools together, from the router)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-plots", action="store_true", help="no PNG plots")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixmesh loadtest",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _target_flags(p)
    _workload_flags(p)
    _arrival_flags(p)
    _result_flags(p)
    return p


def _bench_options(args: argparse.Namespace, num_requests: int) -> BenchOptions:
    """How to run and report the workload, from the flags."""
    return BenchOptions(
        limits=RunLimits(
            args.max_duration, args.drain_timeout, args.request_timeout, args.concurrency
        ),
        warmup=min(args.warmup, num_requests - 1),
        slo=parse_slo(args.slo) if args.slo else None,
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        progress=not args.no_progress,
        plots=not args.no_plots,
        settings={
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k != "api_key"  # summaries get shared; keys must not travel with them
        },
    )


async def _run(args: argparse.Namespace, console: Console) -> int:
    requests = build_workload(args)
    # Everything built so far lives for the whole run: keep the collector from rescanning it,
    # which would stall the scheduler for milliseconds at high request rates.
    gc.collect()
    gc.freeze()
    if not requests:
        console.print("[red]the workload is empty[/red]")
        return 2
    opts = _bench_options(args, len(requests))
    out = args.out or Path("loadtest-results") / time.strftime("%Y%m%d-%H%M%S")
    protocol = args.protocol or protocol_of(args.target)
    # Read here, not as the argparse default, so --help never prints the key.
    api_key = os.environ.get("PREFIXMESH_API_KEY", "") if args.api_key is None else args.api_key
    if args.compare and protocol == "http" and (args.cluster or "none").lower() == "none":
        console.print(
            "[red]--compare with an HTTP target needs --cluster HOST:PORT "
            "(the router's gRPC address, for its Cluster service)[/red]"
        )
        return 2
    client = make_client(
        protocol,
        args.target,
        args.channels,
        api_key=api_key,
        model=args.model,
        # closed loop: one connection per worker; open loop: as many as requests in flight
        max_connections=args.concurrency if args.arrival == "closed" else 0,
        tls_files=tls.client_files(args),
    )
    cluster_addr = args.cluster
    if cluster_addr is None:
        cluster_addr = args.target if protocol == "grpc" else "none"
    cluster = (
        None
        if cluster_addr.lower() == "none"
        else ClusterClient(cluster_addr, api_key, tls.client_files(args))
    )
    try:
        await client.wait_ready(timeout=30.0)
        if args.compare:
            if cluster is None or await cluster.snapshot() is None:
                console.print("[red]--compare needs a router (Cluster service)[/red]")
                return 2
            policies = [p.strip() for p in args.compare.split(",") if p.strip()]
            summaries = await compare_policies(
                policies, client, cluster, requests, opts, out, console
            )
            print_comparison(summaries, console)
        else:
            salt = args.cache_salt
            if salt == "auto":
                salt = f"loadtest-{uuid.uuid4().hex[:8]}"
            results, summary = await run_once(
                "loadtest", client, cluster, requests, opts, salt, console
            )
            save_run(results, summary, out, opts.plots)
            print_summary(summary, console)
        console.print(f"results in {out}/")
        return 0
    except ClientError as e:
        console.print(f"[red]{e}[/red]")
        return 1
    finally:
        await client.close()
        if cluster is not None:
            await cluster.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workload is None:
        args.workload = "trace" if args.trace else "shared-prefix"
    console = Console()
    try:
        return event_loop.run(_run(args, console))
    except ValueError as e:
        print(f"prefixmesh loadtest: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
