"""`prefixmesh top`: one frame against an in-process gRPC Cluster/Replica pair, and rates."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest

from prefixmesh.cli import top
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc


def _state(replica_address: str) -> pb.ClusterState:
    return pb.ClusterState(
        policy="cache_aware",
        router_id="router-test",
        redis_connected=True,
        replicas=[
            pb.ReplicaInfo(
                replica_id="replica-a", address=replica_address, requests=8, prompt_tokens=400,
                cached_tokens=300, hit_rate=0.75, cached_blocks=12,
                load=pb.ReplicaLoad(replica_id="replica-a", running=3, waiting=1, kv_usage=0.5),
            ),
            # Unreachable on purpose: its row must still show the router's view.
            pb.ReplicaInfo(
                replica_id="replica-b", address="127.0.0.1:1", requests=2, prompt_tokens=100,
                cached_tokens=12, hit_rate=0.125,
                load=pb.ReplicaLoad(replica_id="replica-b", running=0, waiting=0, kv_usage=0.0),
            ),
        ],
        routing=pb.RoutingStats(
            decisions={"warm": 7, "cold": 3}, requests=10, prompt_tokens=500,
            actual_cached_tokens=312, hit_rate=0.624, failovers=1,
            misses={"hit": 19, "compulsory": 6, "evicted": 3, "elsewhere": 1, "stale": 1,
                    "cacheable": 30},
        ),
    )  # fmt: skip


def _check_key(context: grpc.ServicerContext, key: str) -> None:
    """What prefixmesh.auth.ApiKeyInterceptor does on the real servers (those are grpc.aio)."""
    if key and dict(context.invocation_metadata()).get("authorization") != f"Bearer {key}":
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")


class _Cluster(pb_grpc.ClusterServicer):
    def __init__(self, key: str = "") -> None:
        self.address = ""
        self.key = key

    def ListReplicas(self, request, context):  # noqa: N802 (gRPC method name)
        _check_key(context, self.key)
        return _state(self.address)


class _Replica(pb_grpc.ReplicaServicer):
    def __init__(self, key: str = "") -> None:
        self.key = key

    def GetStats(self, request, context):  # noqa: N802
        _check_key(context, self.key)
        return pb.ReplicaStats(
            prefix_cache_queries=400,
            prefix_cache_hits=100,
            generation_tokens=50,
            epoch="e1",
            fetched_tokens=4321,
        )

    def GetModelInfo(self, request, context):  # noqa: N802
        _check_key(context, self.key)
        return pb.ModelInfo(kernel_build="cpu_ops avx512 (prebuilt)", dtype="bfloat16")


@contextmanager
def _serve(router_key: str = "", replica_key: str = "") -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    cluster = _Cluster(router_key)
    pb_grpc.add_ClusterServicer_to_server(cluster, server)
    pb_grpc.add_ReplicaServicer_to_server(_Replica(replica_key), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    cluster.address = f"127.0.0.1:{port}"  # the same server plays replica-a
    try:
        yield cluster.address
    finally:
        server.stop(grace=None)


@pytest.fixture
def fake_router() -> Iterator[str]:
    with _serve() as address:
        yield address


def test_once_renders_every_replica_hit_rate(fake_router: str, capsys) -> None:
    assert top.main(["--router", fake_router, "--once"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if "replica-" in ln and not ln.startswith("kernels")]
    lines = {line.split()[1]: line for line in rows}
    assert set(lines) == {"replica-a", "replica-b"}
    assert "75.0%" in lines["replica-a"] and "12.5%" in lines["replica-b"]
    assert "25.0%" in lines["replica-a"]  # engine-side hit rate from Replica.GetStats
    assert "4321" in lines["replica-a"]  # tokens it fetched from peers
    # Replica.GetModelInfo; the same server plays replica-a only
    assert "kernels: cpu_ops avx512 (prebuilt) bfloat16 on replica-a" in out
    assert "cluster hit rate 62.4%" in out
    assert "cold 3" in out and "warm 7" in out and "failovers 1" in out
    # the router's miss attribution, in blocks and as shares of the cacheable ones
    assert "compulsory 6 (20.0%)" in out and "evicted 3 (10.0%)" in out
    assert "elsewhere 1 (3.3%)" in out and "stale 1 (3.3%)" in out


def test_once_reports_unreachable_router() -> None:
    assert top.main(["--router", "127.0.0.1:1", "--once"]) == 1


def test_api_key_goes_to_the_router_and_the_replicas(monkeypatch, capsys) -> None:
    monkeypatch.delenv("PREFIXMESH_API_KEY", raising=False)
    with _serve("k1", "k1") as address:
        assert top.main(["--router", address, "--once", "--api-key", "k1"]) == 0
        out = capsys.readouterr().out
        assert "25.0%" in out and "refused" not in out  # GetStats answered with the key
        monkeypatch.setenv("PREFIXMESH_API_KEY", "k1")
        assert top.main(["--router", address, "--once"]) == 0
        assert "25.0%" in capsys.readouterr().out
        monkeypatch.delenv("PREFIXMESH_API_KEY")
        assert top.main(["--router", address, "--once"]) == 1
        err = capsys.readouterr().err
        assert "UNAUTHENTICATED: invalid or missing API key" in err
        assert "pass --api-key or set PREFIXMESH_API_KEY" in err and "Traceback" not in err
    # The router takes the key, replica-a wants another one: its row says so, top goes on.
    with _serve("k1", "k2") as address:
        assert top.main(["--router", address, "--once", "--api-key", "k1"]) == 0
        out = capsys.readouterr().out
        assert "replica stats: replica-a refused the API key" in out
        assert "25.0%" not in out


def test_tokens_per_second_from_deltas() -> None:
    state = _state("x:1")

    def snap(at: float, gen: int, epoch: str = "e1") -> top.Snapshot:
        stats = pb.ReplicaStats(generation_tokens=gen, epoch=epoch)
        return top.Snapshot(at=at, state=state, stats={"replica-a": stats})

    assert top._rate(snap(10.0, 150), snap(8.0, 50), "replica-a") == "50.0"
    assert top._rate(snap(10.0, 150), None, "replica-a") == "-"
    assert top._rate(snap(10.0, 5, "e2"), snap(8.0, 50), "replica-a") == "-"  # restarted
    assert top._rate(snap(10.0, 150), snap(8.0, 50), "replica-b") == "-"  # no stats
