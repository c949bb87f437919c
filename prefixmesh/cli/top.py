"""``prefixmesh top``: a live terminal view of every replica's hit rate and load.

Each refresh reads the router's ``Cluster.ListReplicas`` and, unless ``--no-replica-stats``,
each replica's ``Replica.GetStats`` (engine-side hit rate, generated tokens). Rates (tokens/s)
are deltas between two refreshes, so the first frame shows ``-`` for them. ``--once`` prints
one frame and exits (scripts and tests). ``--api-key`` goes to the router and to the replicas.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from prefixmesh import tls
from prefixmesh.auth import bearer_metadata, client_api_key, missing_key_hint
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

DEFAULT_ROUTER = "127.0.0.1:50050"


@dataclass(slots=True)
class Snapshot:
    """One refresh: the router's view plus each replica's own stats (where reachable)."""

    at: float
    state: pb.ClusterState
    stats: dict[str, pb.ReplicaStats] = field(default_factory=dict)  # by replica_id
    refused: list[str] = field(default_factory=list)  # replicas that refused the API key
    kernels: dict[str, str] = field(default_factory=dict)  # by replica_id: "cpu_ops avx512 ..."


class Poller:
    """Keeps one channel to the router and one per replica address across refreshes."""

    def __init__(
        self,
        router: str,
        replica_stats: bool = True,
        timeout_s: float = 2.0,
        api_key: str = "",
        tls_files: tls.TlsFiles | None = None,
    ) -> None:
        self.router = router
        self.replica_stats = replica_stats
        self.timeout_s = timeout_s
        self._metadata = bearer_metadata(api_key) or None
        self._tls = tls_files  # --tls-ca (+ client certificate): the replicas' CA too
        self._router_channel = tls.channel(router, tls_files)
        self._cluster = pb_grpc.ClusterStub(self._router_channel)
        self._replicas: dict[str, tuple[grpc.Channel, pb_grpc.ReplicaStub]] = {}
        self._kernels: dict[str, str] = {}  # by address: asked once, it never changes

    def poll(self) -> Snapshot:
        state = self._cluster.ListReplicas(
            pb.Empty(), timeout=self.timeout_s, metadata=self._metadata
        )
        snap = Snapshot(at=time.monotonic(), state=state)
        if self.replica_stats:
            for info in state.replicas:
                try:
                    stats = self._replica_stats(info.address)
                except grpc.RpcError as err:  # the row still shows the router's view
                    if err.code() is grpc.StatusCode.UNAUTHENTICATED:
                        snap.refused.append(info.replica_id)
                    continue
                if stats is not None:
                    snap.stats[info.replica_id] = stats
                    snap.kernels[info.replica_id] = self._kernel_build(info.address)
        return snap

    def _kernel_build(self, address: str) -> str:
        if address not in self._kernels:
            stub = self._replicas[address][1]
            try:
                info = stub.GetModelInfo(
                    pb.Empty(), timeout=self.timeout_s, metadata=self._metadata
                )
            except grpc.RpcError:  # an older replica: asked again next refresh
                return "?"
            self._kernels[address] = f"{info.kernel_build or '?'} {info.dtype}".strip()
        return self._kernels[address]

    def _replica_stats(self, address: str) -> pb.ReplicaStats | None:
        if not address:
            return None
        if address not in self._replicas:
            channel = tls.channel(address, self._tls)
            self._replicas[address] = (channel, pb_grpc.ReplicaStub(channel))
        stub = self._replicas[address][1]
        return stub.GetStats(pb.Empty(), timeout=self.timeout_s, metadata=self._metadata)

    def close(self) -> None:
        self._router_channel.close()
        for channel, _ in self._replicas.values():
            channel.close()


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _rate(cur: Snapshot, prev: Snapshot | None, replica_id: str) -> str:
    """Generated tokens/s between two refreshes (``-`` without two samples)."""
    if prev is None or replica_id not in cur.stats or replica_id not in prev.stats:
        return "-"
    dt = cur.at - prev.at
    now, before = cur.stats[replica_id], prev.stats[replica_id]
    if dt <= 0 or now.epoch != before.epoch:  # a restarted replica's counters began again
        return "-"
    return f"{(now.generation_tokens - before.generation_tokens) / dt:.1f}"


def _kernels(by_replica: dict[str, str]) -> Text:
    """One line: each kernel build and dtype in use, with the replicas running it."""
    builds: dict[str, list[str]] = {}
    for replica_id, build in sorted(by_replica.items()):
        builds.setdefault(build, []).append(replica_id)
    line = Text("kernels: ")
    for build, ids in builds.items():
        # The torch path is several times slower on a CPU: an operator must not miss it.
        line.append(build, style="bold red" if build.startswith("torch path") else "bold")
        line.append(f" on {', '.join(ids)}   ")
    return line


def _hit_bar(rate: float, width: int = 10) -> Text:
    filled = round(rate * width)
    color = "green" if rate >= 0.5 else "yellow" if rate >= 0.2 else "red"
    return Text("█" * filled + "·" * (width - filled), style=color)


def render(cur: Snapshot, prev: Snapshot | None = None) -> Group:
    """One frame: a header line, the per-replica table, and the routing decisions."""
    s = cur.state
    r = s.routing
    redis = Text("redis ok", style="green") if s.redis_connected else Text("redis DOWN", "red")
    header = Text.assemble(
        ("prefixmesh top", "bold"), f"  router {s.router_id or '?'}  policy {s.policy}  ",
        redis, f"  replicas {len(s.replicas)}  requests {r.requests}  ",
        ("cluster hit rate ", ""), (_pct(r.hit_rate).strip(), "bold"),
        f"  ({r.actual_cached_tokens}/{r.prompt_tokens} prompt tokens cached)",
    )  # fmt: skip
    table = Table(expand=False, header_style="bold")
    for col, justify in (
        ("replica", "left"), ("address", "left"), ("hit rate", "right"), ("", "left"),
        ("engine hit", "right"), ("requests", "right"), ("running", "right"),
        ("waiting", "right"), ("KV use", "right"), ("cached blocks", "right"),
        ("fetched tok", "right"), ("gen tok/s", "right"), ("preempt r/s", "right"),
        ("recomputed tok", "right"),
    ):  # fmt: skip
        table.add_column(col, justify=justify, no_wrap=True)
    for info in sorted(s.replicas, key=lambda i: i.replica_id):
        stats = cur.stats.get(info.replica_id)
        engine_hit = "-"
        if stats is not None and stats.prefix_cache_queries:
            engine_hit = _pct(stats.prefix_cache_hits / stats.prefix_cache_queries)
        load = info.load
        # The replica's own count is exact; the router's is what Redis holds (may lag).
        blocks = stats.cached_blocks if stats is not None else info.cached_blocks
        # Prompt tokens whose KV the replica fetched from a peer (replica/fetch/client.py).
        fetched = str(stats.fetched_tokens) if stats is not None else "-"
        # Preemptions by recompute / by swap, and the tokens recompute cost (issue 53).
        preempt = f"{stats.recompute_preemptions}/{stats.swap_preemptions}" if stats else "-"
        recomputed = str(stats.recomputed_tokens) if stats is not None else "-"
        table.add_row(
            info.replica_id, info.address, _pct(info.hit_rate), _hit_bar(info.hit_rate),
            engine_hit, str(info.requests), str(load.running), str(load.waiting),
            _pct(load.kv_usage), str(blocks), fetched, _rate(cur, prev, info.replica_id),
            preempt, recomputed,
        )  # fmt: skip
    if not s.replicas:
        table.add_row("(no live replicas)", *[""] * 13)
    decisions = "  ".join(f"{k} {v}" for k, v in sorted(r.decisions.items())) or "none yet"
    routing = Text(
        f"routing: {decisions}   retries {r.retries}  failovers {r.failovers}  "
        f"errors {r.errors}   predicted cached {r.predicted_cached_tokens} / actual "
        f"{r.actual_cached_tokens} tokens"
    )
    parts = [header, table, _kernels(cur.kernels), routing, _misses(r)]
    if not cur.refused:
        return Group(*parts)
    refused = Text(
        f"replica stats: {', '.join(cur.refused)} refused the API key (--api-key / "
        "PREFIXMESH_API_KEY must be the replicas' key; --no-replica-stats asks only the router)",
        style="yellow",
    )
    return Group(*parts, refused)


def _misses(r: pb.RoutingStats) -> Text:
    """Prompt blocks by fate, from the router's miss attribution (router/attribution.py)."""
    total = r.misses.get("cacheable", 0)
    if not total:
        return Text("prompt blocks: none attributed yet")
    kinds = ("hit", "compulsory", "evicted", "elsewhere", "stale")
    return Text(
        "prompt blocks: "
        + "  ".join(f"{k} {r.misses.get(k, 0)} ({_pct(r.misses.get(k, 0) / total).strip()})"
                    for k in kinds)
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixmesh top",
        description="Live view of every replica behind a prefixmesh router: prefix hit rate, "
        "running and waiting requests, KV cache use, tokens/s and routing decisions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--router",
        default=os.environ.get("PREFIXMESH_ROUTER", DEFAULT_ROUTER),
        help="router address host:port [env PREFIXMESH_ROUTER]",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="API key sent to the router and to each replica (for their stats) as gRPC "
        "metadata 'authorization: Bearer <key>' [env PREFIXMESH_API_KEY] (value not shown)",
    )
    tls.add_client_flags(parser)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument(
        "--replica-stats",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also ask each replica for its own stats (engine hit rate, tok/s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    api_key = client_api_key(args.api_key)
    poller = Poller(
        args.router, replica_stats=args.replica_stats, api_key=api_key,
        tls_files=tls.client_files(args),
    )  # fmt: skip
    # A pipe gets a wide fixed console (14 columns), so one frame is one table, none elided.
    console = Console() if sys.stdout.isatty() else Console(width=200, color_system=None)
    try:
        if args.once:
            console.print(render(poller.poll()))
            return 0
        prev: Snapshot | None = None
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                try:
                    cur = poller.poll()
                    live.update(render(cur, prev), refresh=True)
                    prev = cur
                except grpc.RpcError as err:
                    if err.code() is grpc.StatusCode.UNAUTHENTICATED:
                        raise  # a key does not fix itself: say so and exit
                    live.update(
                        Text(
                            f"router {args.router}: {err.code().name} {err.details()} (retrying)",
                            style="red",
                        ),
                        refresh=True,
                    )
                time.sleep(args.interval)
    except grpc.RpcError as err:
        hint = missing_key_hint(err.code(), api_key)
        print(
            f"prefixmesh top: router {args.router}: {err.code().name}: {err.details()}{hint}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        poller.close()


if __name__ == "__main__":
    sys.exit(main())
