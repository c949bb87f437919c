"""Fetch-on-miss in a real cluster: Redis, two replica processes and a router process (tiny
model). The router's round robin sends the second request of a prefix past the replica holding
it, with a fetch hint; that replica fetches the prefix. A frozen holder (SIGSTOP) makes the
fetch time out: the replica prefills instead, and the client sees the same output, no error."""

from __future__ import annotations

import random
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from helpers import Proc, free_port, start_redis, wait_until

from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.cluster
NS = "ftc"


def _generate(stub, ids: list[int], salt: str = "") -> tuple[list[int], pb.Usage, str]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), cache_salt=salt,
        sampling=pb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    )  # fmt: skip
    tokens: list[int] = []
    last = pb.GenerateResponse()
    for msg in stub.Generate(request, timeout=60):
        tokens += msg.token_ids
        last = msg
    return tokens, last.usage, last.replica_id


def test_router_hint_fetch_and_a_frozen_holder(tiny_model_dir: Path) -> None:
    redis = start_redis()
    ports = {name: free_port() for name in ("fa-0", "fa-1", "router")}
    metrics = {name: free_port() for name in ("fa-0", "fa-1")}
    procs = [
        Proc.cli(name, "replica", "--model", str(tiny_model_dir), "--port", str(ports[name]),
                 "--redis", redis.url, "--namespace", NS, "--replica-id", name,
                 "--threads", "1", "--dtype", "float32", "--num-blocks", "64",
                 "--max-model-len", "512", "--fetch-prefill-tokens-per-s", "100",
                 "--metrics-port", str(metrics[name]))
        for name in ("fa-0", "fa-1")
    ]  # fmt: skip
    procs.append(Proc.cli("router", "router", "--port", str(ports["router"]), "--redis",
                          redis.url, "--namespace", NS, "--policy", "round_robin"))  # fmt: skip
    channels = {n: grpc.insecure_channel(f"127.0.0.1:{p}") for n, p in ports.items()}
    router = pb_grpc.GeneratorStub(channels["router"])
    cluster = pb_grpc.ClusterStub(channels["router"])
    replicas = {n: pb_grpc.GeneratorStub(channels[n]) for n in ("fa-0", "fa-1")}
    admin = {n: pb_grpc.ReplicaStub(channels[n]) for n in ("fa-0", "fa-1")}
    try:
        wait_until(procs, lambda: len(cluster.ListReplicas(pb.Empty(), timeout=2).replicas) == 2,
                   "cluster")  # fmt: skip
        wait_until(procs, lambda: bool(_generate(router, [5, 6, 7])), "router")
        rng = random.Random(0)
        first = [rng.randrange(5, 400) for _ in range(100)]
        _, _, holder = _generate(router, first)
        other = next(n for n in replicas if n != holder)
        _wait_in_redis(procs, cluster, holder)
        # Round robin sends the same prefix to the other replica, naming the holder.
        tokens, usage, served = _generate(router, first + [9, 9])
        assert served == other and usage.cached_tokens == 96 and usage.fetched_tokens == 96
        cold, cold_usage, _ = _generate(replicas[other], first + [9, 9], salt="cold")
        assert cold_usage.cached_tokens == 0 and tokens == cold
        # A frozen holder: the fetch times out, the replica prefills, the output is the same.
        second = [rng.randrange(5, 400) for _ in range(100)]
        _generate(replicas[holder], second)
        _wait_in_redis(procs, cluster, holder, blocks=12)
        procs[list(replicas).index(holder)].proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        tokens, usage, served = _generate(replicas[other], second + [8, 8])
        assert served == other and usage.fetched_tokens == 0 and usage.cached_tokens == 0
        assert time.monotonic() - started < 10  # the fetch's deadline, not the client's
        assert _fetches(metrics[other], "timeout") == 1  # it did try, and gave up in time
        assert _fetches(metrics[other], "fetched") == 1  # the first prefix, through the router
        cold, _, _ = _generate(replicas[other], second + [8, 8], salt="cold")
        assert tokens == cold
        state = admin[other].GetCacheState(pb.Empty(), timeout=10)
        assert state.integrity_ok and state.used_blocks == 0
        procs[list(replicas).index(holder)].proc.send_signal(signal.SIGCONT)
        state = admin[holder].GetCacheState(pb.Empty(), timeout=10)
        assert state.integrity_ok, state.integrity_error
        _wait_unpinned(procs, admin[holder])
    finally:
        for channel in channels.values():
            channel.close()
        for proc in reversed(procs):
            proc.stop()
        redis.stop()


def _fetches(port: int, outcome: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith("prefixmesh_kv_fetches_total{") and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_in_redis(procs, cluster, holder: str, blocks: int = 6) -> None:
    """Until the router sees ``blocks`` cached blocks on ``holder`` (its KV events landed)."""

    def landed() -> bool:
        state = cluster.ListReplicas(pb.Empty(), timeout=2)
        return any(r.replica_id == holder and r.cached_blocks >= blocks for r in state.replicas)

    wait_until(procs, landed, "KV events in Redis", timeout=30)


def _wait_unpinned(procs, admin) -> None:
    """The holder released the transfer's pin once its stream ended (the asker gave up)."""
    wait_until(
        procs,
        lambda: admin.GetCacheState(pb.Empty(), timeout=5).used_blocks == 0,
        "the holder's pins released",
        timeout=30,
    )
