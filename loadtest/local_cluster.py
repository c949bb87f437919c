"""Redis, replicas and routers as local processes, for the load tests that compare routers.

``LocalCluster`` starts Redis (as ``prefixmesh up`` does), ``--replicas`` replicas, each with an
OpenAI HTTP port, and ``routers`` routers (gRPC + HTTP) on one Redis, every one a subprocess
logging to its own file; ``loadtest_argv`` is the load tester's command for one window of a
trace. Shared by ``loadtest.sglang_side_by_side`` (our router against sglang-router on the
same replicas) and ``loadtest.two_routers`` (one router against two on one Redis), so that
both start the cluster and replay the window the same way. Torch-free: the children import
torch, not this process.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prefixmesh.ports import free_port, free_ports

ROOT = Path(__file__).resolve().parent.parent
# Redis as a child process, started the way ``prefixmesh up`` starts it (the load tester does
# not import the CLI package; the child does).
_REDIS = (
    "import os, sys; from prefixmesh.redis_server import redis_command; "
    "c = redis_command(int(sys.argv[1])); os.execv(c[0], c)"
)


def above_replicas() -> None:
    """In a child: one real-time priority above this process's, when it runs under
    ``chrt -f``. Every child inherits SCHED_FIFO, and a replica's forward pass then keeps its
    core until it blocks, so Redis and the routers (light, and on every request's path) would
    wait behind it: Redis timed out under our router and it routed blind. Every router gets
    the same boost."""
    if os.sched_getscheduler(0) == os.SCHED_FIFO:
        prio = os.sched_getparam(0).sched_priority
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(prio + 1))


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefixmesh.cli", *args]


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_http(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_ok(u) for u in urls):
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"exited before ready: {dead}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout_s}s: {urls}")
        time.sleep(1.0)


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no server on port {port} ({proc.args})") from None
            time.sleep(0.5)


class LocalCluster:
    """Redis, replicas with HTTP ports, and ``routers`` routers on that Redis, as subprocesses
    logging to ``logs``."""

    def __init__(self, args: argparse.Namespace, logs: Path, routers: int = 1) -> None:
        self.args, self.logs, self.num_routers = args, logs, routers
        self.procs: list[subprocess.Popen[bytes]] = []
        self.replica_http: list[str] = []
        self.routers: list[tuple[str, str]] = []  # (gRPC address, HTTP base URL) each

    @property
    def router_grpc(self) -> str:
        return self.routers[0][0]

    @property
    def router_http(self) -> str:
        return self.routers[0][1]

    def _spawn(self, name: str, argv: list[str], boost: bool = False) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=above_replicas if boost else None,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        a = self.args
        redis = a.redis
        if not redis:
            port = free_port()
            proc = self._spawn("redis", [sys.executable, "-c", _REDIS, str(port)], True)
            redis = f"redis://127.0.0.1:{port}/0"
            _wait_port(port, proc, 60.0)
        # Picked together: one by one, a port closed a moment ago can come back (free_ports).
        ports = iter(free_ports(2 * (a.replicas + self.num_routers)))
        for i in range(a.replicas):
            g, h = next(ports), next(ports)
            self._spawn(f"replica-{i}", cli(
                "replica", "--host", "127.0.0.1", "--port", str(g), "--http-port", str(h),
                "--replica-id", f"replica-{i}", "--redis", redis, "--model", a.model,
                "--threads", str(a.threads), "--block-size", str(a.block_size),
                *a.replica_arg,
            ))  # fmt: skip
            self.replica_http.append(f"http://127.0.0.1:{h}")
        for k in range(self.num_routers):
            g, h = next(ports), next(ports)
            self._spawn("router" if k == 0 else f"router-{k}", cli(
                "router", "--port", str(g), "--http-port", str(h), "--redis", redis,
                "--policy", a.policy, *a.router_arg,
            ), True)  # fmt: skip
            self.routers.append((f"127.0.0.1:{g}", f"http://127.0.0.1:{h}"))
        health = [f"{u}/health" for u in self.replica_http]
        health += [f"{http}/health" for _, http in self.routers]
        wait_http(health, self.procs, a.startup_timeout)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def loadtest_argv(
    args: argparse.Namespace,
    target: str,
    cluster: str,
    out: Path,
    *,
    prompt_format: str = "text",
    concurrency: int | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The load tester's command for the window of ``args`` (``add_window_flags``) against one
    router: the same workload and arrivals for every router (``concurrency`` overrides the
    closed loop's; ``extra``: more load tester flags)."""
    if args.arrival == "closed":
        workers = args.concurrency if concurrency is None else concurrency
        arrival = ["--arrival", "closed", "--concurrency", str(workers)]
    else:  # the trace's own times, ``--speedup`` times faster
        arrival = ["--arrival", "trace", "--speedup", str(args.speedup)]
    model = ["--model", args.served_model] if target.startswith("http") else []
    return cli(
        "loadtest", "--target", target, "--cluster", cluster, *model,
        "--trace", str(args.trace), "--prompt-format", prompt_format,
        "--tokens-per-hash-id", str(args.tokens_per_hash_id), "--limit", str(args.limit),
        "--trace-start", str(args.trace_start),
        "--max-output-tokens", str(args.max_tokens), *arrival,
        "--block-size", str(args.block_size),
        "--max-duration", str(args.max_duration), "--no-progress", "--no-plots",
        "--out", str(out), *extra,
    )  # fmt: skip


def run_order(order: str, known: tuple[str, ...]) -> list[str]:
    """``--order``'s comma-separated names, each one of ``known`` (ValueError naming the rest)."""
    names = [name.strip() for name in order.split(",") if name.strip()]
    if bad := [name for name in names if name not in known]:
        raise ValueError(f"--order: unknown names {bad} (known: {', '.join(known)})")
    return names


def logs_under(out: Path) -> Path:
    """Creates ``out`` and its ``logs`` folder, where ``LocalCluster`` writes; returns the
    latter."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The cluster ``LocalCluster`` starts."""
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--redis", default="", help="Redis URL (default: start one)")
    p.add_argument("--model", default="smollm2", help="replicas' --model")
    p.add_argument("--served-model", default="smollm2", help="the HTTP body's model field")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", default="cache_aware", help="our router's policy")
    p.add_argument("--replica-arg", action="append", default=[], help="extra replica flag")
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag")
    p.add_argument("--startup-timeout", type=float, default=600.0)


def add_window_flags(p: argparse.ArgumentParser, limit: int = 1000) -> None:
    """The trace window every router replays (``loadtest_argv``)."""
    p.add_argument(
        "--trace", type=Path, default=Path("../shared/data/traces/synthetic_trace.jsonl")
    )
    p.add_argument("--tokens-per-hash-id", type=int, default=16)
    p.add_argument("--limit", type=int, default=limit)
    p.add_argument(
        "--trace-start", type=float, default=0.0,
        help="the window's start, in trace seconds (python -m loadtest.sweep lists starts)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument(
        "--arrival", choices=("closed", "trace"), default="closed",
        help="closed: a closed loop of --concurrency; trace: the trace's own arrival times",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight")
    p.add_argument(
        "--speedup", type=float, default=1.0, help="trace arrivals: this many times faster"
    )
    p.add_argument("--max-duration", type=float, default=900.0)
