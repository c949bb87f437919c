"""Redis + one tiny-model replica + one router, as real processes on loopback, for the
hardening tests (limits, fuzzing, TLS, tenants). Each server serves gRPC and OpenAI HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import free_port, start_redis

from prefixmesh.tls import TlsFiles, channel
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: str

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixmesh.cli", *argv],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )  # fmt: skip
        log.close()
        return cls(name, proc, log.name)

    def logs(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if os.environ.get("PM_KEEP_LOGS"):
            print(f"--- {self.name}\n{self.logs()}")
        Path(self.log_path).unlink(missing_ok=True)


@dataclass
class MiniCluster:
    """Addresses are host:port; ``client_tls`` is what a client needs to dial them."""

    replica_grpc: str
    replica_http: str
    router_grpc: str
    router_http: str
    procs: list[Proc]
    redis: object
    client_tls: TlsFiles = field(default_factory=TlsFiles)

    def channel(self, address: str, tls: TlsFiles | None = None) -> grpc.Channel:
        return channel(address, self.client_tls if tls is None else tls)

    def cache_state(self) -> pb.CacheState:
        with self.channel(self.replica_grpc) as ch:
            return pb_grpc.ReplicaStub(ch).GetCacheState(pb.Empty(), timeout=10)

    def wait_idle(self, timeout: float = 30.0) -> pb.CacheState:
        """The replica's cache state once no request runs and no block is referenced."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.cache_state()
            if state.inflight_requests == 0 and state.used_blocks == 0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"replica not idle: {state.inflight_requests} in flight, "
                    f"{state.used_blocks} blocks used"
                )
            time.sleep(0.05)

    def alive(self) -> None:
        dead = [p for p in self.procs if p.proc.poll() is not None]
        assert not dead, f"{dead[0].name} exited:\n{dead[0].logs()}"

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.redis.stop()  # type: ignore[attr-defined]


def _serving(address: str, tls: TlsFiles) -> bool:
    try:
        with channel(address, tls) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _routes(address: str, tls: TlsFiles) -> bool:
    try:
        with channel(address, tls) as ch:
            state = pb_grpc.ClusterStub(ch).ListReplicas(pb.Empty(), timeout=1)
        return len(state.replicas) == 1
    except grpc.RpcError:
        return False


def start_mini_cluster(
    model: str,
    replica_args: tuple[str, ...] = (),
    router_args: tuple[str, ...] = (),
    replica_env: dict[str, str] | None = None,
    router_env: dict[str, str] | None = None,
    client_tls: TlsFiles | None = None,
    namespace: str = "hard",
    timeout: float = 180.0,
) -> MiniCluster:
    redis = start_redis()
    rg, rh, qg, qh = (free_port() for _ in range(4))
    procs: list[Proc] = []
    tls = client_tls or TlsFiles()
    try:
        procs.append(Proc.start("replica", [
            "replica", "--model", model, "--port", str(rg), "--http-port", str(rh),
            "--redis", redis.url, "--namespace", namespace, "--replica-id", f"{namespace}-0",
            "--threads", "1", "--dtype", "float32", "--max-model-len", "512",
            "--num-blocks", "128", "--max-num-seqs", "8", *replica_args,
        ], replica_env))  # fmt: skip
        procs.append(Proc.start("router", [
            "router", "--port", str(qg), "--http-port", str(qh), "--redis", redis.url,
            "--namespace", namespace, *router_args,
        ], router_env))  # fmt: skip
        cluster = MiniCluster(
            f"127.0.0.1:{rg}", f"127.0.0.1:{rh}", f"127.0.0.1:{qg}", f"127.0.0.1:{qh}",
            procs, redis, tls,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not (_serving(cluster.replica_grpc, tls) and _routes(cluster.router_grpc, tls)):
            cluster.alive()
            if time.monotonic() > deadline:
                raise TimeoutError("cluster not ready:\n" + "\n".join(p.logs() for p in procs))
            time.sleep(0.3)
        # The router routes once it has the replica's tokenizer: wait for one answered request.
        while True:
            try:
                with channel(cluster.router_grpc, tls) as ch:
                    list(pb_grpc.GeneratorStub(ch).Generate(
                        pb.GenerateRequest(text="warm up", sampling=pb.SamplingParams(
                            max_tokens=1, temperature=0)), timeout=30))  # fmt: skip
                break
            except grpc.RpcError:
                cluster.alive()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        return cluster
    except BaseException:
        for p in reversed(procs):
            p.stop()
        redis.stop()
        raise
