"""The load tester against a real cluster: Redis, 3 replicas of the tiny model and the router,
all as separate processes over loopback gRPC."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers import Proc, free_port, start_redis, stop_all, wait_until

from loadtest.cli import main as loadtest_main
from loadtest.workload import SAMPLE_TRACE
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.cluster

NUM_REPLICAS = 3
STARTUP_TIMEOUT_S = 120.0


def _lists_every_replica(router: str) -> bool:
    with grpc.insecure_channel(router) as channel:
        state = pb_grpc.ClusterStub(channel).ListReplicas(pb.Empty(), timeout=2.0)
    return len(state.replicas) == NUM_REPLICAS and all(r.block_size for r in state.replicas)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[tuple[str, list[str]]]:
    """(router address, replica addresses)."""
    redis = start_redis()
    procs: list[Proc] = []
    replicas = [f"127.0.0.1:{free_port()}" for _ in range(NUM_REPLICAS)]
    try:
        for i, address in enumerate(replicas):
            procs.append(Proc.cli(f"r{i}", *[
                "replica", "--port", address.rsplit(":", 1)[1], "--redis", redis.url,
                "--model", str(tiny_model_dir), "--replica-id", f"r{i}", "--threads", "1",
                "--num-blocks", "512",
                # Policies are compared on routing alone: with fetching (docs/fetch.md) round
                # robin's replicas copy the prefix from each other and hit as often.
                "--no-fetch",
            ]))  # fmt: skip
        router = f"127.0.0.1:{free_port()}"
        procs.append(Proc.cli("router", *[
            "router", "--port", router.rsplit(":", 1)[1], "--redis", redis.url,
        ]))  # fmt: skip
        wait_until(
            procs, lambda: _lists_every_replica(router), "the router's replicas", STARTUP_TIMEOUT_S
        )
        yield router, replicas
    finally:
        stop_all(procs)
        redis.stop()


def _vocab_args(tiny_model_dir: Path) -> list[str]:
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    return ["--vocab-size", str(vocab), "--min-token-id", "3"]  # ids 0-2: special tokens


def test_trace_slice_against_three_replicas(
    cluster: tuple[str, list[str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    router_address = cluster[0]
    rc = loadtest_main([
        "--target", router_address, "--trace", str(SAMPLE_TRACE), "--tokens-per-hash-id", "16",
        "--max-output-tokens", "4", "--speedup", "8", "--limit", "40", "--warmup", "2",
        "--out", str(tmp_path), "--no-progress", "--request-timeout", "60",
        *_vocab_args(tiny_model_dir),
    ])  # fmt: skip
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"]["ok"] == summary["requests"]["sent"] == 38
    assert summary["requests"]["wrong_output_length"] == 0
    replicas = summary["cluster"]["replicas"]
    assert len(replicas) == NUM_REPLICAS
    assert sum(r["requests"] for r in replicas.values()) == 38
    assert all("hit_rate" in r for r in replicas.values())
    assert summary["block_size"] == 16
    # The trace shares prefixes, and no routing beats an unlimited cache holding every prompt.
    best = summary["best_hit_rate"]
    assert best > 0.3
    assert 0 < summary["cluster"]["hit_rate"] <= best + 1e-9
    assert (tmp_path / "hit_rate.png").stat().st_size > 0


def test_compare_policies_on_shared_prefixes(
    cluster: tuple[str, list[str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    router_address = cluster[0]
    rc = loadtest_main([
        "--target", router_address, "--workload", "shared-prefix", "--num-groups", "3",
        "--prompts-per-group", "6", "--system-prompt-len", "96", "--question-len", "8",
        "--output-len", "4", "--arrival", "closed", "--concurrency", "2",
        "--compare", "cache_aware,round_robin", "--out", str(tmp_path), "--no-progress",
        "--no-plots", "--request-timeout", "60", *_vocab_args(tiny_model_dir),
    ])  # fmt: skip
    assert rc == 0
    policies = json.loads((tmp_path / "compare.json").read_text())["policies"]
    for policy, s in policies.items():
        assert s["cluster"]["policy"] == policy
        assert s["requests"]["ok"] == 18
        assert sum(r["requests"] for r in s["cluster"]["replicas"].values()) == 18
    # Round robin spreads each group over all replicas, so every replica prefills every system
    # prompt; cache-aware routing keeps a group on the replica that already holds it.
    aware, rr = policies["cache_aware"]["cluster"], policies["round_robin"]["cluster"]
    assert aware["hit_rate"] > rr["hit_rate"]


def test_direct_to_one_replica(
    cluster: tuple[str, list[str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A replica has no Cluster service: per-replica numbers come from the responses' usage."""
    rc = loadtest_main([
        "--target", cluster[1][0], "--trace", str(SAMPLE_TRACE), "--limit", "12",
        "--speedup", "20", "--max-output-tokens", "3", "--out", str(tmp_path), "--no-progress",
        "--no-plots", "--request-timeout", "60", *_vocab_args(tiny_model_dir),
    ])  # fmt: skip
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "cluster" not in summary
    assert summary["requests"]["ok"] == 12
    assert list(summary["per_replica"]) == ["r0"]
    assert summary["per_replica"]["r0"]["requests"] == 12
    assert summary["block_size"] == 16
    assert summary["hit_rate"] <= summary["best_hit_rate"] + 1e-9
