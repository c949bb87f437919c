"""The router's ``Cluster`` service seen by the load tester: counters snapshotted before and
after a run (results are the deltas), and policy switching for ``--compare``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from loadtest.grpc_client import channel_options
from prefixmesh.tls import aio_channel
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc


@dataclass(slots=True)
class ReplicaCounters:
    replica_id: str
    address: str = ""
    block_size: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_blocks: int = 0  # the replica's KV block pool (its lease)
    # Replica.GetStats' preemption and queue counters (PREEMPTION_FIELDS), when it answered.
    preemption: dict[str, float] = field(default_factory=dict)


PREEMPTION_FIELDS = ("recompute_preemptions", "swap_preemptions", "recomputed_tokens",
                     "swapped_out_blocks", "swapped_in_blocks", "queue_time_s", "admissions")  # fmt: skip


@dataclass(slots=True)
class ClusterSnapshot:
    """Cumulative counters of one ``ListReplicas`` answer."""

    policy: str
    replicas: dict[str, ReplicaCounters] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)
    routing: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)  # blocks by fate (router/attribution.py)

    @classmethod
    def from_proto(cls, state: pb.ClusterState) -> ClusterSnapshot:
        snap = cls(policy=state.policy)
        for r in state.replicas:
            snap.replicas[r.replica_id] = ReplicaCounters(
                r.replica_id, r.address, r.block_size, r.requests, r.prompt_tokens,
                r.cached_tokens, r.load.num_blocks,
            )  # fmt: skip
        snap.decisions = dict(state.routing.decisions)
        snap.misses = dict(state.routing.misses)
        rt = state.routing
        snap.routing = {
            "requests": rt.requests,
            "prompt_tokens": rt.prompt_tokens,
            "actual_cached_tokens": rt.actual_cached_tokens,
            "predicted_cached_tokens": rt.predicted_cached_tokens,
            "retries": rt.retries,
            "failovers": rt.failovers,
            "errors": rt.errors,
        }
        return snap

    @property
    def block_size(self) -> int | None:
        sizes = {r.block_size for r in self.replicas.values() if r.block_size}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def capacity_blocks(self) -> int | None:
        """All live replicas' KV pools together (None if some replica does not report one)."""
        pools = [r.num_blocks for r in self.replicas.values()]
        return sum(pools) if pools and all(pools) else None


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def cluster_delta(before: ClusterSnapshot, after: ClusterSnapshot) -> dict[str, Any]:
    """What happened between two snapshots: per-replica requests and hit rate, routing."""
    replicas: dict[str, Any] = {}
    for rid, a in sorted(after.replicas.items()):
        b = before.replicas.get(rid, ReplicaCounters(rid))
        if a.requests < b.requests:  # stats were reset in between: count from zero
            b = ReplicaCounters(rid)
        prompt, cached = a.prompt_tokens - b.prompt_tokens, a.cached_tokens - b.cached_tokens
        replicas[rid] = {
            "address": a.address,
            "requests": a.requests - b.requests,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": _rate(cached, prompt),
            "preemption": {k: v - b.preemption.get(k, 0) for k, v in a.preemption.items()},
        }

    reset = after.routing.get("requests", 0) < before.routing.get("requests", 0)
    base_routing = {} if reset else before.routing
    base_decisions = {} if reset else before.decisions
    routing = {k: v - base_routing.get(k, 0) for k, v in after.routing.items()}
    decisions = {
        k: v - base_decisions.get(k, 0)
        for k, v in sorted(after.decisions.items())
        if v - base_decisions.get(k, 0)
    }
    base_misses = {} if reset else before.misses
    misses = {k: v - base_misses.get(k, 0) for k, v in after.misses.items()}
    return {
        "policy": after.policy,
        "replicas": replicas,
        "decisions": decisions,
        "misses": misses,
        "routing": routing,
        "hit_rate": _rate(routing.get("actual_cached_tokens", 0), routing.get("prompt_tokens", 0)),
        "preemption": {  # summed over the replicas that answered GetStats
            k: sum(r["preemption"].get(k, 0) for r in replicas.values()) for k in PREEMPTION_FIELDS
        },
    }


class ClusterClient:
    """Thin async wrapper over the router's Cluster service."""

    def __init__(self, target: str, api_key: str = "", tls_files: Any = None) -> None:
        self._channel = aio_channel(target, tls_files, options=channel_options(-1))
        self._tls = tls_files  # the replicas' channels too (GetStats)
        self._stub = pb_grpc.ClusterStub(self._channel)
        # A router started with --api-key wants it as gRPC metadata (prefixmesh.auth).
        self._md = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def snapshot(self, timeout: float = 10.0) -> ClusterSnapshot | None:
        """The current counters, or None when the target is not a router."""
        try:
            state = await self._stub.ListReplicas(pb.Empty(), timeout=timeout, metadata=self._md)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                return None
            raise
        snap = ClusterSnapshot.from_proto(state)
        for r in snap.replicas.values():
            r.preemption = await self._preemption(r.address, timeout)
        return snap

    async def _preemption(self, address: str, timeout: float) -> dict[str, float]:
        """A replica's preemption counters (empty when it cannot be asked)."""
        try:
            async with aio_channel(address, self._tls, options=channel_options(-1)) as ch:
                s = await pb_grpc.ReplicaStub(ch).GetStats(
                    pb.Empty(), timeout=timeout, metadata=self._md
                )
        except grpc.aio.AioRpcError:
            return {}
        return {k: getattr(s, k) for k in PREEMPTION_FIELDS}

    async def replica_block_size(self, timeout: float = 10.0) -> int | None:
        """The block size of a replica target (``Replica.GetModelInfo``), None if not one."""
        try:
            info = await pb_grpc.ReplicaStub(self._channel).GetModelInfo(
                pb.Empty(), timeout=timeout, metadata=self._md
            )
        except grpc.aio.AioRpcError:
            return None
        return info.block_size or None

    async def replica_num_blocks(self, timeout: float = 10.0) -> int | None:
        """The KV pool of a replica target (``Replica.GetLoad``), None if not one."""
        try:
            load = await pb_grpc.ReplicaStub(self._channel).GetLoad(
                pb.Empty(), timeout=timeout, metadata=self._md
            )
        except grpc.aio.AioRpcError:
            return None
        return load.num_blocks or None

    async def set_policy(self, policy: str, timeout: float = 10.0) -> ClusterSnapshot:
        state = await self._stub.SetPolicy(
            pb.SetPolicyRequest(policy=policy), timeout=timeout, metadata=self._md
        )
        return ClusterSnapshot.from_proto(state)

    async def reset_stats(self, timeout: float = 10.0) -> None:
        await self._stub.ResetStats(pb.Empty(), timeout=timeout, metadata=self._md)

    async def close(self) -> None:
        await self._channel.close()
