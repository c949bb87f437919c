"""``prefixmesh up``: Redis, N replicas and the router on this machine, in one command.

Start order: Redis (embedded unless ``--redis`` is given), the model resolved once (so N
replicas do not fetch/convert it at once), the replicas (each waited for until gRPC health says
SERVING), then the router. Every child's output is streamed with a ``name |`` prefix. Ctrl-C or
SIGTERM stops the router, then the replicas, then Redis (SIGTERM, grace period, SIGKILL).

It keeps serving by default: a child that dies is restarted on the same port with backoff (1 s,
doubling to 30 s); ``--no-restart`` leaves it dead. Redis dying never stops the cluster (the
router routes from its local view and replicas keep serving; they resync the prefix map when
Redis is back); only the router dying under ``--no-restart`` does, since nothing is left to
serve clients then.
``--api-key`` reaches the router and every replica through their environment, never their
command lines (which are logged).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prefixmesh.auth import API_KEY_ENV, bearer_metadata, client_api_key
from prefixmesh.ports import port_picker
from prefixmesh.procs import (
    Child,
    LogSink,
    ProcessSpec,
    Supervisor,
    describe_exit,
    wait_serving,
)
from prefixmesh.redis_server import find_redis_server, redis_command, wait_for_redis
from prefixmesh.tls import TlsFiles
from prefixmesh.tls import channel as tls_channel

DEFAULT_ROUTER_PORT = 50050  # the router's own default (router/config.py)
ROUTER = "router"
REDIS = "redis"


@dataclass(frozen=True, slots=True)
class UpConfig:
    """One ``prefixmesh up`` invocation."""

    replicas: int = 2
    model: str = "smollm2"
    host: str = "127.0.0.1"
    port: int = DEFAULT_ROUTER_PORT
    http_port: int = 8000  # the router's OpenAI-compatible HTTP; 0 = off
    redis: str = ""
    policy: str = "cache_aware"
    block_size: int = 16
    threads: int = 0
    metrics: bool = False
    restart: bool = True
    grace_period: float = 15.0  # the replica drains for 10 s by default
    startup_timeout: float = 600.0
    color: bool = True
    replica_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    api_key: str = field(default="", repr=False)  # the router's and every replica's
    # TLS: one certificate for this host serves the router and every replica (--tls-cert/key);
    # --tls-ca verifies it; --tls-client-ca makes replicas require client certificates.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_ca: str = ""

    def tls_files(self) -> TlsFiles | None:
        """What up's own probes present and trust (None: plaintext)."""
        if not self.tls_cert:
            return None
        return TlsFiles(self.tls_cert, self.tls_key, "", self.tls_ca)

    def threads_per_replica(self) -> int:
        """Split the cores between replicas, so N replicas do not oversubscribe the CPU."""
        return self.threads or max(1, _usable_cores() // self.replicas)


def _usable_cores() -> int:
    """Cores this process may run on (a container's cpuset, not the host's core count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixmesh up",
        description="Run a whole prefixmesh cluster on this machine: Redis, N replicas and the "
        "router, with prefixed logs. Ctrl-C stops everything.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # Hand-written, not settings.build_parser: up's own flags do not read PREFIXMESH_*
    # variables (those configure its children), except --api-key, which it hands on.
    d = UpConfig()
    _cluster_flags(parser, d)
    _supervision_flags(parser, d)
    _tls_flags(parser)
    return parser


def _tls_flags(parser: argparse.ArgumentParser) -> None:
    """TLS on every gRPC and HTTP door of the cluster (prefixmesh/tls.py)."""
    g = parser.add_argument_group("TLS")
    g.add_argument(
        "--tls-cert", default="",
        help="PEM certificate of this host, served by the router and every replica (its "
        "names must cover --host and 127.0.0.1); the router also presents it to replicas",
    )  # fmt: skip
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-ca", default="",
        help="PEM CA that signed --tls-cert (required with it): the router verifies the "
        "replicas with it, and clients need it (generate/top/loadtest --tls-ca)",
    )  # fmt: skip
    g.add_argument(
        "--tls-client-ca", default="",
        help="PEM CA whose client certificates the replicas require (mutual TLS between "
        "router and replicas; the router's door for clients stays server-side TLS only)",
    )  # fmt: skip


def _check_tls(args: argparse.Namespace) -> None:
    """TlsFiles' own checks, plus up's: one certificate serves everything, so the router
    needs the CA that signed it to verify the replicas."""
    files = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca, args.tls_ca)
    problems = files.problems()
    if args.tls_cert and not args.tls_ca:
        problems.append("--tls-cert needs --tls-ca (the CA that signed it)")
    if args.tls_ca and not args.tls_cert:
        problems.append("--tls-ca needs --tls-cert and --tls-key")
    if problems:
        raise SystemExit("prefixmesh up: " + "; ".join(problems))


def _cluster_flags(parser: argparse.ArgumentParser, d: UpConfig) -> None:
    """The cluster's shape: replicas, model, addresses, Redis, policy, threads."""
    parser.add_argument("--replicas", "-n", type=int, default=d.replicas, help="replicas")
    parser.add_argument(
        "--model", default=d.model, help="model name ('smollm2'), Hugging Face folder or .gguf file"
    )
    parser.add_argument(
        "--host",
        default=d.host,
        help="interface for the router (replicas and Redis stay on loopback "
        "unless this is not loopback)",
    )
    parser.add_argument("--port", type=int, default=d.port, help="router gRPC port")
    parser.add_argument(
        "--http-port",
        type=int,
        default=d.http_port,
        help="router OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions); 0 = off",
    )
    parser.add_argument(
        "--redis",
        default=d.redis,
        help="external Redis URL (default: start an embedded redis-server)",
    )
    parser.add_argument("--policy", default=d.policy, help="router policy")
    parser.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens per KV block on every replica"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="torch threads per replica (0 = max(1, cores // replicas))",
    )


def _supervision_flags(parser: argparse.ArgumentParser, d: UpConfig) -> None:
    """How the children run: metrics, restarts, timeouts, logs, extra flags, the API key."""
    parser.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=d.metrics,
        help="give every process a free Prometheus /metrics port (printed)",
    )
    parser.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=d.restart,
        help="restart a child that dies, on the same port, with backoff (1 s doubling to 30 s); "
        "--no-restart leaves it dead (the cluster then stops only if the router dies)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=d.grace_period,
        help="seconds children get after SIGTERM before SIGKILL",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=d.startup_timeout,
        help="seconds to wait for each process to report SERVING",
    )
    parser.add_argument(
        "--color",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="colored name prefixes (default: when stdout is a terminal)",
    )
    parser.add_argument(
        "--replica-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag passed to every replica (repeat; e.g. --replica-arg=--num-blocks=256)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag passed to the router (repeat)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="API key of the router and every replica (their --api-key): clients send "
        "'Authorization: Bearer <key>' [env PREFIXMESH_API_KEY] (value not shown)",
    )


def parse_config(argv: list[str]) -> UpConfig:
    args = build_parser().parse_args(argv)
    if args.replicas < 1:
        raise SystemExit(f"prefixmesh up: --replicas must be >= 1 (got {args.replicas})")
    _check_tls(args)
    color = args.color
    if color is None:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    return UpConfig(
        replicas=args.replicas, model=args.model, host=args.host, port=args.port,
        http_port=args.http_port,
        redis=args.redis, policy=args.policy, block_size=args.block_size, threads=args.threads,
        metrics=args.metrics, restart=args.restart, grace_period=args.grace_period,
        startup_timeout=args.startup_timeout, color=color,
        replica_args=tuple(args.replica_arg), router_args=tuple(args.router_arg),
        api_key=client_api_key(args.api_key),
        tls_cert=_absolute(args.tls_cert), tls_key=_absolute(args.tls_key),
        tls_ca=_absolute(args.tls_ca), tls_client_ca=_absolute(args.tls_client_ca),
    )  # fmt: skip


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else ""


def _cli(*args: str) -> list[str]:
    """A ``prefixmesh`` subcommand run by this very interpreter (works without the script)."""
    return [sys.executable, "-m", "prefixmesh.cli", *args]


def resolve_model_once(model: str, sup: Supervisor) -> None:
    """Fetch/convert a named or GGUF model before N replicas race for it.

    Runs in a child interpreter: conversion imports transformers, which ``up`` itself never needs.
    """
    if Path(model).expanduser().is_dir():
        return
    sup.log(f"resolving model {model!r} (first run downloads and converts it once)")
    code = (
        "import sys; from replica.loader import resolve_model; "
        "print(resolve_model(sys.argv[1]).path)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, model], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"could not resolve model {model!r}:\n{done.stderr.strip()}")
    sup.log(f"model {model!r} is at {done.stdout.strip()}")


@dataclass
class Plan:
    """The concrete processes of one cluster (ports chosen up front, so restarts reuse them)."""

    redis_url: str
    redis_spec: ProcessSpec | None
    replica_specs: list[ProcessSpec]
    replica_addresses: list[str]
    router_spec: ProcessSpec
    router_address: str
    metrics: dict[str, int]


def make_plan(cfg: UpConfig) -> Plan:
    # Every port the plan hands out is held until all are picked, so no two are the same.
    with port_picker("127.0.0.1") as pick:
        return _make_plan(cfg, pick)


def _make_plan(cfg: UpConfig, pick: Callable[[], int]) -> Plan:
    inner_host = "127.0.0.1"
    redis_spec = None
    redis_url = cfg.redis
    if not redis_url:
        port = pick()
        # Not critical: the router and the replicas serve on without Redis.
        redis_spec = ProcessSpec(REDIS, redis_command(port, inner_host, find_redis_server()))
        redis_url = f"redis://{inner_host}:{port}/0"
    metrics: dict[str, int] = {}
    # Set even when empty, so an explicit `--api-key ""` beats a PREFIXMESH_API_KEY in the
    # environment; the router presents its own key to the replicas (they have the same one).
    replica_env = {API_KEY_ENV: cfg.api_key}
    router_env = {API_KEY_ENV: cfg.api_key, "PREFIXMESH_REPLICA_API_KEY": ""}
    if cfg.tls_cert:  # by environment, as compose and k8s hand TLS files over
        served = {"PREFIXMESH_TLS_CERT": cfg.tls_cert, "PREFIXMESH_TLS_KEY": cfg.tls_key,
                  "PREFIXMESH_TLS_CA": cfg.tls_ca}  # fmt: skip
        replica_env |= served | {"PREFIXMESH_TLS_CLIENT_CA": cfg.tls_client_ca}
        router_env |= served
    threads = cfg.threads_per_replica()
    replica_specs, addresses = [], []
    for i in range(cfg.replicas):
        name, port = f"replica-{i}", pick()
        argv = _cli(
            "replica", "--host", inner_host, "--port", str(port),
            "--advertise-host", inner_host, "--replica-id", name, "--redis", redis_url,
            "--model", cfg.model, "--threads", str(threads),
            "--block-size", str(cfg.block_size),
        )  # fmt: skip
        if cfg.metrics:
            metrics[name] = pick()
            argv += ["--metrics-port", str(metrics[name])]
        replica_specs.append(ProcessSpec(name, argv + list(cfg.replica_args), replica_env))
        addresses.append(f"{inner_host}:{port}")
    router_argv = _cli(
        "router", "--host", cfg.host, "--port", str(cfg.port), "--redis", redis_url,
        "--policy", cfg.policy,
    )  # fmt: skip
    if cfg.http_port:
        router_argv += ["--http-port", str(cfg.http_port)]
    if cfg.metrics:
        metrics[ROUTER] = pick()
        router_argv += ["--metrics-port", str(metrics[ROUTER])]
    router_spec = ProcessSpec(
        ROUTER, router_argv + list(cfg.router_args), router_env, critical=True
    )
    dial_host = inner_host if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    return Plan(redis_url, redis_spec, replica_specs, addresses, router_spec,
                f"{dial_host}:{cfg.port}", metrics)  # fmt: skip


def banner(cfg: UpConfig, plan: Plan) -> str:
    """What to try once the cluster is up (never the API key itself: it names the variable)."""
    r = plan.router_address
    lines = [
        f"prefixmesh is up: router {r}, {cfg.replicas} replica(s) "
        f"({', '.join(plan.replica_addresses)}), redis {plan.redis_url}",
    ]
    grpc_auth = http_auth = ""
    if cfg.api_key:
        lines.append(
            f"API key required by the router and the replicas: export {API_KEY_ENV}=<key> "
            "(or pass --api-key <key>) for generate, top and loadtest"
        )
        grpc_auth = f' -H "authorization: Bearer ${API_KEY_ENV}"'
        http_auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"'
    tls_flag, grpcurl_tls, scheme, curl_tls = "", "-plaintext", "http", ""
    if cfg.tls_cert:
        lines.append(f"TLS on every door: clients trust {cfg.tls_ca}")
        tls_flag, grpcurl_tls = f" --tls-ca {cfg.tls_ca}", f"-cacert {cfg.tls_ca}"
        scheme, curl_tls = "https", f" --cacert {cfg.tls_ca}"
    lines += [
        "try:",
        f'  prefixmesh generate --router {r}{tls_flag} "Write a haiku about caches."',
        f'  prefixmesh generate --router {r}{tls_flag} --chat "What is the capital of France?"',
        f"  prefixmesh top --router {r}{tls_flag}",
        f"  grpcurl {grpcurl_tls}{grpc_auth} "
        + """-d '{"text": "Hello", "sampling": {"max_tokens": 32}}' """
        + f"{r} prefixmesh.v1.Generator/Generate",
    ]
    if cfg.http_port:
        dial = r.rsplit(":", 1)[0]
        lines.append(
            f"  curl{curl_tls} {scheme}://{dial}:{cfg.http_port}/v1/chat/completions{http_auth}"
            + """ -H 'Content-Type: application/json' -d '{"model": "smollm2", """
            + """"messages": [{"role": "user", "content": "Hello"}]}'"""
        )
    if plan.metrics:
        lines.append(
            "metrics: "
            + ", ".join(
                f"{name} http://127.0.0.1:{port}/metrics" for name, port in plan.metrics.items()
            )
        )
    lines.append("Ctrl-C to stop.")
    return "\n".join(lines)


def wait_router_sees(
    address: str,
    replicas: int,
    timeout_s: float,
    stop: threading.Event,
    api_key: str = "",
    tls: TlsFiles | None = None,
) -> int:
    """Wait until the router lists ``replicas`` replicas (discovery runs on a timer)."""
    import grpc

    from proto import prefixmesh_pb2 as pb
    from proto import prefixmesh_pb2_grpc as pb_grpc

    deadline, seen = time.monotonic() + timeout_s, 0
    with tls_channel(address, tls) as channel:
        stub = pb_grpc.ClusterStub(channel)
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                state = stub.ListReplicas(
                    pb.Empty(), timeout=2.0, metadata=bearer_metadata(api_key) or None
                )
                seen = len(state.replicas)
            except grpc.RpcError:
                pass
            if seen >= replicas:
                break
            time.sleep(0.2)
    return seen


class Cluster:
    """Runs a Plan under a Supervisor until stopped."""

    def __init__(self, cfg: UpConfig, plan: Plan, sup: Supervisor, stop: threading.Event):
        self.cfg, self.plan, self.sup, self.stop = cfg, plan, sup, stop
        self.failed = False
        self._backoff: dict[str, float] = {}
        self._due: dict[str, tuple[float, ProcessSpec, int]] = {}  # name -> (when, spec, n)

    def start(self) -> bool:
        """Bring everything up; False if interrupted or a process failed to start."""
        cfg, plan, sup = self.cfg, self.plan, self.sup
        try:
            if plan.redis_spec is not None:
                child = sup.start(plan.redis_spec)
                port = int(plan.redis_url.rsplit(":", 1)[1].split("/")[0])
                wait_for_redis("127.0.0.1", port, timeout_s=15)
                if not child.alive():
                    raise RuntimeError("redis-server exited at start")
            resolve_model_once(cfg.model, sup)
            children = [sup.start(spec) for spec in plan.replica_specs]
            tls = cfg.tls_files()
            for child, address in zip(children, plan.replica_addresses, strict=True):
                wait_serving(address, cfg.startup_timeout, child.alive, self.stop, tls)
                sup.log(f"{child.name} is SERVING on {address}")
            router = sup.start(plan.router_spec)
            wait_serving(plan.router_address, cfg.startup_timeout, router.alive, self.stop, tls)
            seen = wait_router_sees(
                plan.router_address, cfg.replicas, 30.0, self.stop, cfg.api_key, tls
            )
            if seen < cfg.replicas and not self.stop.is_set():
                sup.log(f"warning: the router lists {seen} of {cfg.replicas} replicas so far")
        except (RuntimeError, TimeoutError) as exc:
            if not self.stop.is_set():
                sup.log(f"start failed: {exc}")
                self.failed = True
            return False
        sup.sink.out.write(banner(cfg, plan) + "\n")
        sup.sink.out.flush()
        return True

    def watch(self) -> None:
        """Report (and with --restart, restart) children that die, until stopped."""
        while not self.stop.wait(0.2):
            for child in self.sup.exited():
                self._on_exit(child)
            now = time.monotonic()
            for name, (when, spec, n) in list(self._due.items()):
                if now >= when:
                    del self._due[name]
                    self.sup.start(spec, restarts=n)
            if self.failed:
                return

    def _on_exit(self, child: Child) -> None:
        code = child.proc.returncode
        self.sup.log(f"{child.name} (pid {child.pid}) {describe_exit(code)}")
        if self.cfg.restart:
            # Back off 1 s, doubling up to 30 s; a child that ran a minute starts afresh.
            ran = time.monotonic() - child.started_at
            delay = 1.0 if ran > 60 else min(30.0, self._backoff.get(child.name, 0.5) * 2)
            self._backoff[child.name] = delay
            self.sup.log(f"restarting {child.name} in {delay:.0f}s")
            self._due[child.name] = (time.monotonic() + delay, child.spec, child.restarts + 1)
        elif child.spec.critical:
            self.sup.log(f"{child.name} is required: stopping the cluster (--no-restart is set)")
            self.failed = True
        elif child.name == REDIS:
            self.sup.log(
                "redis is not restarted (--no-restart): the router and the replicas keep "
                "serving without the shared prefix map"
            )
        else:
            self.sup.log(f"{child.name} is not restarted (--no-restart is set)")


def _children_import_this_tree() -> None:
    """Children run ``python -m prefixmesh.cli``: make sure they import this very source tree,
    also when ``up`` runs from a checkout that is not installed and from another directory."""
    root = str(Path(__file__).resolve().parents[2])  # prefixmesh/cli/up.py -> the tree
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    sink = LogSink(color=cfg.color, width=max(len(ROUTER), len(f"replica-{cfg.replicas - 1}")))
    sup = Supervisor(sink, grace_s=cfg.grace_period)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        # A second Ctrl-C means "now": skip the grace period. A repeated SIGTERM does not (process
        # managers and `timeout` may deliver it twice).
        if stop.is_set() and signum == signal.SIGINT:
            sup.grace_s = 0.0
        stop.set()

    _children_import_this_tree()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        plan = make_plan(cfg)
    except RuntimeError as exc:  # e.g. no redis-server anywhere
        print(f"prefixmesh up: {exc}", file=sys.stderr)
        return 1
    cluster = Cluster(cfg, plan, sup, stop)
    if cluster.start():
        cluster.watch()
    sup.log("shutting down")
    killed = sup.shutdown(order=[[ROUTER], [s.name for s in plan.replica_specs]])
    for child in sup.exited():
        sup.log(f"{child.name} (pid {child.pid}) {describe_exit(child.proc.returncode)}")
    if killed:
        sup.log(f"had to SIGKILL: {', '.join(killed)}")
    sup.log("stopped")
    return 1 if cluster.failed else 0


if __name__ == "__main__":
    sys.exit(main())
