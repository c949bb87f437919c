"""Fetch-on-miss in a real cluster: Redis, two replica processes and a router process (tiny
model). The router's round robin sends the second request of a prefix past the replica holding
it, with a fetch hint; that replica fetches the prefix. A frozen holder (SIGSTOP) makes the
fetch time out: the replica prefills instead, and the client sees the same output, no error.
A holder killed (SIGKILL) while a fetch from it is open ends that fetch at once: the asker
prefills, same output, no error."""

from __future__ import annotations

import random
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis as redis_client
from helpers import Proc, free_port, start_redis, wait_until

from prefixmesh import redis_layout
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
        # It did try, and gave up in time. (Failed once in a CI-like run while a compile loaded
        # both cores, never since: the message says which way the replica went instead.)
        assert _fetches(metrics[other], "timeout") == 1, _fetch_story(procs, metrics, other)
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


def test_holder_killed_mid_fetch(tiny_model_dir: Path) -> None:
    """SIGSTOP the holder so the asker's FetchBlocks stream is open and waiting, then SIGKILL
    it: the stream breaks (not its deadline, 10 s away), the asker prefills, the client sees
    the cold run's output and no error, and the asker's pool is intact with nothing held."""
    redis = start_redis()
    names = ("fk-0", "fk-1")
    ports = {name: free_port() for name in names}
    metrics = {name: free_port() for name in names}
    procs = [
        Proc.cli(name, "replica", "--model", str(tiny_model_dir), "--port", str(ports[name]),
                 "--redis", redis.url, "--namespace", "ftk", "--replica-id", name,
                 "--threads", "1", "--dtype", "float32", "--num-blocks", "64",
                 "--max-model-len", "512", "--fetch-prefill-tokens-per-s", "10",
                 "--fetch-timeout", "10", "--metrics-port", str(metrics[name]))
        for name in names
    ]  # fmt: skip
    channels = {n: grpc.insecure_channel(f"127.0.0.1:{p}") for n, p in ports.items()}
    gen = {n: pb_grpc.GeneratorStub(channels[n]) for n in names}
    holder, asker = names
    try:
        wait_until(procs, lambda: all(bool(_generate(g, [5, 6, 7])) for g in gen.values()),
                   "replicas")  # fmt: skip
        prompt = [random.Random(1).randrange(5, 400) for _ in range(100)]
        _generate(gen[holder], prompt)
        channels.pop(holder).close()  # so the only connection to the holder is the asker's
        _wait_in_redis_map(procs, redis.url, holder, blocks=6)
        procs[0].proc.send_signal(signal.SIGSTOP)
        result: dict[str, object] = {}

        def ask() -> None:
            try:
                result["out"] = _generate(gen[asker], prompt + [8, 8])
            except grpc.RpcError as exc:  # the test fails on it below
                result["error"] = exc

        started = time.monotonic()
        client = threading.Thread(target=ask)
        client.start()
        wait_until(procs[1:], lambda: _connected(ports[holder]), "the asker dialling the holder")
        time.sleep(0.2)  # its FetchBlocks call is on that connection, waiting for blocks
        procs[0].proc.kill()
        procs[0].proc.wait(timeout=10)
        client.join(timeout=30)
        assert "error" not in result, result.get("error")
        tokens, usage, served = result["out"]  # type: ignore[misc]
        assert served == asker and usage.fetched_tokens == 0 and usage.cached_tokens == 0
        assert time.monotonic() - started < 8  # the kill ended the fetch, not its deadline
        assert _fetches(metrics[asker], "failed") == 1 and _fetches(metrics[asker], "timeout") == 0
        cold, _, _ = _generate(gen[asker], prompt + [8, 8], salt="cold")
        assert tokens == cold
        state = pb_grpc.ReplicaStub(channels[asker]).GetCacheState(pb.Empty(), timeout=10)
        assert state.integrity_ok and state.used_blocks == 0
    finally:
        for channel in channels.values():
            channel.close()
        for proc in reversed(procs):
            if proc.alive():
                proc.stop()
        redis.stop()


def _wait_in_redis_map(procs, url: str, holder: str, blocks: int) -> None:
    """Until the holder's block set in Redis has ``blocks`` hashes (its KV events landed)."""
    client = redis_client.Redis.from_url(url)
    key = redis_layout.blocks_key(holder, "ftk")
    try:
        wait_until(procs, lambda: client.scard(key) >= blocks, "KV events in Redis", timeout=30)
    finally:
        client.close()


def _connected(port: int) -> bool:
    """Some socket on this machine has an established TCP connection to ``port`` (Linux)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def _fetch_story(procs, metrics: dict[str, int], name: str) -> str:
    """A replica's fetch counters by outcome and the end of its log, for a failure message:
    a fetch it skipped on cost, one that failed otherwise, and one it never tried (no holder
    found: a Redis lookup that timed out stops lookups for a while) all read 0 timeouts."""
    counters = _fetch_counters(metrics[name])
    log = next(p for p in procs if p.name == name).logs(2000)
    return "fetch counters: " + "; ".join(counters or ["none"]) + f"\n{name}'s log:\n{log}"


def _fetch_counters(port: int) -> list[str]:
    """The replica's ``prefixmesh_kv_fetches_total`` lines, one per outcome."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [line for line in body.splitlines() if line.startswith("prefixmesh_kv_fetches_total{")]


def _fetches(port: int, outcome: str) -> float:
    for line in _fetch_counters(port):
        if f'outcome="{outcome}"' in line:
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
