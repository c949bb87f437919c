"""Redis + one tiny-model replica + one router, as real processes on loopback, for the
hardening tests (limits, fuzzing, TLS, tenants). Each server serves gRPC and OpenAI HTTP.
Processes and Redis come from ``tests/helpers.py``, the one harness."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import ROOT, EmbeddedRedis, Proc, free_port, start_redis, stop_all, wait_until

from prefixmesh.tls import TlsFiles, channel
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

__all__ = ["ROOT", "MiniCluster", "start_mini_cluster"]


@dataclass
class MiniCluster:
    """Addresses are host:port; ``client_tls`` is what a client needs to dial them."""

    replica_grpc: str
    replica_http: str
    router_grpc: str
    router_http: str
    procs: list[Proc]
    redis: EmbeddedRedis
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
        stop_all(self.procs)
        self.redis.stop()


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
        procs.append(Proc.cli("replica",
            "replica", "--model", model, "--port", str(rg), "--http-port", str(rh),
            "--redis", redis.url, "--namespace", namespace, "--replica-id", f"{namespace}-0",
            "--threads", "1", "--dtype", "float32", "--max-model-len", "512",
            "--num-blocks", "128", "--max-num-seqs", "8", *replica_args, env=replica_env,
        ))  # fmt: skip
        procs.append(Proc.cli("router",
            "router", "--port", str(qg), "--http-port", str(qh), "--redis", redis.url,
            "--namespace", namespace, *router_args, env=router_env,
        ))  # fmt: skip
        cluster = MiniCluster(
            f"127.0.0.1:{rg}", f"127.0.0.1:{rh}", f"127.0.0.1:{qg}", f"127.0.0.1:{qh}",
            procs, redis, tls,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        wait_until(
            procs,
            lambda: _serving(cluster.replica_grpc, tls) and _routes(cluster.router_grpc, tls),
            "mini cluster",
            timeout,
        )
        # The router routes once it has the replica's tokenizer: wait for one answered request.
        wait_until(
            procs,
            lambda: _answers(cluster.router_grpc, tls),
            "router",
            max(1.0, deadline - time.monotonic()),
        )
        return cluster
    except BaseException:
        stop_all(procs)
        redis.stop()
        raise


def _answers(address: str, tls: TlsFiles) -> bool:
    with channel(address, tls) as ch:
        list(pb_grpc.GeneratorStub(ch).Generate(
            pb.GenerateRequest(text="warm up", sampling=pb.SamplingParams(
                max_tokens=1, temperature=0)), timeout=30))  # fmt: skip
    return True
