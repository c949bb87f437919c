"""Router overhead benchmark: ``python -m loadtest.router_bench``.

Starts Redis, echo replicas (instant, model-free: loadtest/echo_replica.py, in their own process)
and one router process, then measures from this (client) process:

1. Time to first token through the router minus direct to a replica, p50 and p99, over
   alternating sequential requests (one in flight at a time, so queueing does not count). A
   request is a ``--prompt-tokens`` token-id prompt from one of ``--groups`` shared prefixes
   with ``--suffix-tokens`` random ones after it, so every routed request does the full work:
   hash its blocks, look up every replica's block set, policy, predicted-entry write.
2. Routed requests per second one router process sustains with ``--concurrency`` requests in
   flight for ``--seconds`` (``max_tokens = 1``). The client, the echo replicas and the router
   share the machine's cores, so this is a lower bound of what the router alone can do.
3. CPU time per request of the router, of a routing-free passthrough proxy (the floor of any
   Python gRPC hop) and of the echo replicas, over the sequential phase (from /proc on Linux):
   it tells whether a hop's latency is work on the CPU or waiting for one.

Each map source in ``--map-source`` (default ``redis,mirror``: one Lua round trip per request,
then the in-memory mirror) gets its own router process against the same replicas, so one run
shows before and after. Prints a JSON summary and a Markdown table per source for docs/router.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from prefixmesh import event_loop
from prefixmesh.ports import free_ports
from prefixmesh.redis_server import EmbeddedRedis
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _histogram_quantile(metrics: str, name: str, q: float) -> float:
    """Quantile of a Prometheus histogram from its /metrics text (linear within a bucket)."""
    buckets: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1]
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            share = (rank - below) / (count - below) if count > below else 1.0
            return lower + (upper - lower) * share
        lower, below = upper, count
    return lower


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _request(prefixes: list[list[int]], rng: random.Random, suffix: int = 8) -> pb.GenerateRequest:
    prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(suffix)]
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=1)
    )


async def _ttft(stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest) -> float:
    start = time.perf_counter()
    call = stub.Generate(request, timeout=10)
    async for _ in call:
        first = time.perf_counter() - start
        call.cancel()
        return first
    raise RuntimeError("empty stream")


class _Passthrough(pb_grpc.GeneratorServicer):
    """The floor of any Python gRPC proxy: forward to one fixed replica, no routing at all."""

    def __init__(self, target: str) -> None:
        self.stub = pb_grpc.GeneratorStub(grpc.aio.insecure_channel(target))

    async def Generate(self, request, context):  # noqa: N802
        async for response in self.stub.Generate(request, timeout=context.time_remaining()):
            yield response


async def _serve_passthrough(target: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GeneratorServicer_to_server(_Passthrough(target), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def _wait_for_replicas(cluster: pb_grpc.ClusterStub, replicas: int) -> pb.ClusterState:
    deadline = time.monotonic() + 20
    while True:
        state = await cluster.ListReplicas(pb.Empty())
        if len(state.replicas) == replicas:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"router sees {len(state.replicas)} of {replicas} replicas")
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # the router fetches each model's info once
    return state


async def _sequential(
    stubs: tuple[pb_grpc.GeneratorStub, ...],
    requests: int,
    prefixes: list[list[int]],
    rng: random.Random,
    pids: dict[str, int],
    suffix: int = 8,
) -> tuple[list[list[float]], dict[str, float]]:
    """Phase 1 and 3: TTFT samples per stub, alternating, one in flight; CPU ms per request."""
    for _ in range(50):  # warm up channels, caches, the script cache
        for stub in stubs:
            await _ttft(stub, _request(prefixes, rng, suffix))
    samples: list[list[float]] = [[] for _ in stubs]
    cpu_before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    for _ in range(requests):
        for stub, times in zip(stubs, samples):
            times.append(await _ttft(stub, _request(prefixes, rng, suffix)))
    served = {"echo": len(stubs) * requests}  # every path ends at an echo replica
    cpu_ms = {
        f"cpu_ms_per_request_{name}": (_cpu_seconds(pid) - cpu_before[name])
        * 1000.0
        / served.get(name, requests)
        for name, pid in pids.items()
    }
    return samples, cpu_ms


async def _router_histograms(metrics_port: int) -> dict[str, float]:
    """The router's own view: arrival to upstream call issued, and its map lookup."""
    internal: dict[str, float] = {}
    if metrics_port:
        before = await asyncio.to_thread(_scrape, metrics_port)
        for q in (0.5, 0.99):
            value = _histogram_quantile(before, "router_overhead_seconds", q)
            internal[f"router_internal_p{int(q * 100)}_ms"] = value * 1000.0
            value = _histogram_quantile(before, "router_redis_lookup_seconds", q)
            internal[f"redis_lookup_p{int(q * 100)}_ms"] = value * 1000.0
    return internal


async def _throughput(
    via_router: pb_grpc.GeneratorStub,
    prefixes: list[list[int]],
    concurrency: int,
    seconds: float,
    suffix: int = 8,
) -> float:
    """Phase 2: routed requests per second with ``concurrency`` in flight for ``seconds``."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(seed: int) -> None:
        nonlocal done
        wrng = random.Random(seed)
        while time.perf_counter() < stop_at:
            async for _ in via_router.Generate(_request(prefixes, wrng, suffix), timeout=10):
                pass
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done / (time.perf_counter() - start)


def _latency_summary(
    routed: list[float], straight: list[float], proxied: list[float]
) -> dict[str, float]:
    ms = 1000.0
    return {
        "ttft_router_p50_ms": _percentile(routed, 0.5) * ms,
        "ttft_router_p99_ms": _percentile(routed, 0.99) * ms,
        "ttft_direct_p50_ms": _percentile(straight, 0.5) * ms,
        "ttft_direct_p99_ms": _percentile(straight, 0.99) * ms,
        "overhead_p50_ms": (_percentile(routed, 0.5) - _percentile(straight, 0.5)) * ms,
        "overhead_p99_ms": (_percentile(routed, 0.99) - _percentile(straight, 0.99)) * ms,
        "overhead_mean_ms": (statistics.fmean(routed) - statistics.fmean(straight)) * ms,
        "ttft_passthrough_p50_ms": _percentile(proxied, 0.5) * ms,
        "ttft_passthrough_p99_ms": _percentile(proxied, 0.99) * ms,
        "proxy_hop_p50_ms": (_percentile(proxied, 0.5) - _percentile(straight, 0.5)) * ms,
        "proxy_hop_p99_ms": (_percentile(proxied, 0.99) - _percentile(straight, 0.99)) * ms,
    }


async def _measure(
    args: argparse.Namespace,
    router_addr: str,
    metrics_port: int = 0,
    passthrough: str = "",
    pids: dict[str, int] | None = None,
    baseline: tuple[str, int] | None = None,
) -> dict[str, float]:
    """TTFT samples via the router, direct and via the passthrough proxy, then throughput.

    ``pids`` (router, passthrough, echo) adds each process's CPU time per request it served
    during the sequential phase: how much of a hop is work rather than waiting. ``baseline``
    (address, metrics port): another router (``--baseline``), sampled in the same rotation.
    """
    rng = random.Random(0)
    prefixes = [
        [rng.randrange(1000) for _ in range(args.prompt_tokens)] for _ in range(args.groups)
    ]
    router_ch = grpc.aio.insecure_channel(router_addr)
    cluster = pb_grpc.ClusterStub(router_ch)
    state = await _wait_for_replicas(cluster, args.replicas)
    direct_ch = grpc.aio.insecure_channel(state.replicas[0].address)
    via_router, direct = pb_grpc.GeneratorStub(router_ch), pb_grpc.GeneratorStub(direct_ch)
    proxy_ch = grpc.aio.insecure_channel(passthrough or state.replicas[0].address)
    via_proxy = pb_grpc.GeneratorStub(proxy_ch)
    stubs = (via_router, direct, via_proxy)
    base_ch = grpc.aio.insecure_channel(baseline[0]) if baseline else None
    if base_ch is not None:
        await _wait_for_replicas(pb_grpc.ClusterStub(base_ch), args.replicas)
        stubs += (pb_grpc.GeneratorStub(base_ch),)
    samples, cpu_ms = await _sequential(
        stubs, args.requests, prefixes, rng, pids or {}, args.suffix_tokens
    )
    routed, straight, proxied = samples[:3]
    await proxy_ch.close()

    internal = await _router_histograms(metrics_port)
    if base_ch is not None and baseline is not None:
        await base_ch.close()
        before = _latency_summary(samples[3], straight, proxied)
        internal["baseline_overhead_p50_ms"] = before["overhead_p50_ms"]
        internal["baseline_overhead_p99_ms"] = before["overhead_p99_ms"]
        internal["ttft_baseline_p50_ms"] = before["ttft_router_p50_ms"]
        for key, value in (await _router_histograms(baseline[1])).items():
            internal[f"baseline_{key}"] = value
    await cluster.ResetStats(pb.Empty())
    per_s = await _throughput(
        via_router, prefixes, args.concurrency, args.seconds, args.suffix_tokens
    )
    state = await cluster.ListReplicas(pb.Empty())
    await router_ch.close()
    await direct_ch.close()
    return {
        **_latency_summary(routed, straight, proxied),
        "routed_requests_per_s": per_s,
        "throughput_errors": state.routing.errors,
        "throughput_hit_rate": state.routing.hit_rate,
        **internal,
        **cpu_ms,
    }


def _start(cmd: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)


def _start_router(
    source: str, args: argparse.Namespace, redis_url: str, env: dict[str, str], cwd: Path = ROOT
) -> tuple[subprocess.Popen[str], int, int]:
    """A router process (from the checkout at ``cwd``); returns it, its port and metrics port."""
    port, metrics_port = free_ports(2)
    router = _start([sys.executable, "-m", "prefixmesh.cli", "router", "--port", str(port),
                     "--redis", redis_url, "--policy", args.policy, "--map-source", source,
                     "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
                    env, cwd)  # fmt: skip
    assert router.stdout is not None
    router.stdout.readline()  # "router listening on ..."
    return router, port, metrics_port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.router_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--replicas", type=int, default=3, help="echo replicas")
    parser.add_argument("--requests", type=int, default=500, help="sequential TTFT samples")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="shared prefix length")
    parser.add_argument(
        "--suffix-tokens",
        type=int,
        default=8,
        help="random tokens after the shared prefix (8: a partial block at the default "
        "--prompt-tokens; a block or more adds full blocks no earlier prompt had)",
    )
    parser.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    parser.add_argument("--concurrency", type=int, default=32, help="throughput phase")
    parser.add_argument("--seconds", type=float, default=5.0, help="throughput phase length")
    parser.add_argument("--policy", default="cache_aware", help="router policy")
    parser.add_argument(
        "--map-source", default="redis,mirror", help="router map sources to compare, in turn"
    )
    parser.add_argument("--json", default="", help="also write the summary here")
    parser.add_argument(
        "--baseline",
        default="",
        help="another checkout (e.g. a git worktree at the commit before a change): its router "
        "runs beside this one on the same Redis and replicas and takes its turn in the same "
        "sequential rotation, so before and after see the same machine load",
    )
    parser.add_argument("--serve-passthrough", default="", help=argparse.SUPPRESS)
    return parser


def _print_table(result: dict[str, float], concurrency: int) -> None:
    """The summary as the Markdown table of docs/router.md."""
    print(
        "\n| metric | p50 | p99 |\n|---|---|---|\n"
        f"| TTFT via router (ms) | {result['ttft_router_p50_ms']:.3f} "
        f"| {result['ttft_router_p99_ms']:.3f} |\n"
        f"| TTFT direct (ms) | {result['ttft_direct_p50_ms']:.3f} "
        f"| {result['ttft_direct_p99_ms']:.3f} |\n"
        f"| TTFT via a routing-free Python gRPC proxy (ms) "
        f"| {result['ttft_passthrough_p50_ms']:.3f} | {result['ttft_passthrough_p99_ms']:.3f} |\n"
        f"| router overhead: TTFT difference (ms) | {result['overhead_p50_ms']:.3f} "
        f"| {result['overhead_p99_ms']:.3f} |\n"
        f"| router overhead: arrival to upstream call, router histogram (ms) "
        f"| {result['router_internal_p50_ms']:.3f} | {result['router_internal_p99_ms']:.3f} |\n"
        f"| of which the map lookup, router histogram (ms) "
        f"| {result['redis_lookup_p50_ms']:.3f} | {result['redis_lookup_p99_ms']:.3f} |\n"
        f"| proxy hop alone: passthrough minus direct (ms) | {result['proxy_hop_p50_ms']:.3f} "
        f"| {result['proxy_hop_p99_ms']:.3f} |\n\n"
        + "".join(
            f"CPU per request, {name} process: {result.get(f'cpu_ms_per_request_{name}', 0):.3f} ms"
            "\n"
            for name in ("router", "passthrough", "echo")
        )
        + "\n"
        f"routed requests/s (one router, {concurrency} in flight): "
        f"{result['routed_requests_per_s']:.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.serve_passthrough:  # child process: the no-routing proxy baseline
        event_loop.run(_serve_passthrough(args.serve_passthrough))
        return 0

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[str]] = []
    with EmbeddedRedis() as redis:
        try:
            echo = _start([sys.executable, "-m", "loadtest.echo_replica", "--redis", redis.url,
                           "--count", str(args.replicas)], env)  # fmt: skip
            procs.append(echo)
            assert echo.stdout is not None
            addresses = echo.stdout.readline().split()  # the replicas are registered
            proxy = _start([sys.executable, "-m", "loadtest.router_bench", "--serve-passthrough",
                            addresses[0]], env)  # fmt: skip
            procs.append(proxy)
            assert proxy.stdout is not None
            proxy_addr = f"127.0.0.1:{proxy.stdout.readline().strip()}"
            results = {}
            for source in args.map_source.split(","):
                router, port, metrics_port = _start_router(source, args, redis.url, env)
                pids = {"router": router.pid, "passthrough": proxy.pid, "echo": echo.pid}
                base: subprocess.Popen[str] | None = None
                baseline = None
                if args.baseline:
                    tree = Path(args.baseline).resolve()
                    base, base_port, base_metrics = _start_router(
                        source, args, redis.url, {**env, "PYTHONPATH": str(tree)}, tree
                    )
                    pids["baseline"] = base.pid
                    baseline = (f"127.0.0.1:{base_port}", base_metrics)
                try:
                    results[source] = asyncio.run(
                        _measure(
                            args, f"127.0.0.1:{port}", metrics_port, proxy_addr, pids, baseline
                        )
                    )
                finally:
                    for proc in (router, base):
                        if proc is not None:
                            proc.terminate()
                            proc.wait(timeout=10)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)
    summary = {
        "map_sources": results,
        "replicas": args.replicas, "prompt_tokens": args.prompt_tokens,
        "suffix_tokens": args.suffix_tokens,
        "requests": args.requests, "concurrency": args.concurrency, "cpus": os.cpu_count() or 0,
    }  # fmt: skip
    print(json.dumps(summary, indent=2))
    for source, result in results.items():
        print(f"\n### --map-source {source}")
        _print_table(result, args.concurrency)
    print("\n| map source | router overhead p50 (ms) | proxy hop p50 (ms) | over the hop (ms) |")
    print("|---|---|---|---|")
    for source, r in results.items():
        over = r["overhead_p50_ms"] - r["proxy_hop_p50_ms"]
        print(f"| {source} | {r['overhead_p50_ms']:.3f} | {r['proxy_hop_p50_ms']:.3f} "
              f"| {over:+.3f} |")  # fmt: skip
        if "baseline_overhead_p50_ms" in r:
            over = r["baseline_overhead_p50_ms"] - r["proxy_hop_p50_ms"]
            print(f"| {source}, --baseline | {r['baseline_overhead_p50_ms']:.3f} "
                  f"| {r['proxy_hop_p50_ms']:.3f} | {over:+.3f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
