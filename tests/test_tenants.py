"""Tenant limits: per cache_salt (else API key) caps on concurrent requests and queued prompt
tokens, RESOURCE_EXHAUSTED beyond them, rejections counted per tenant in Prometheus."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from mini_cluster import MiniCluster, start_mini_cluster
from prometheus_client import CollectorRegistry, generate_latest

from prefixmesh.tenants import (
    DEFAULT_TENANT,
    TenantBusy,
    TenantLimiter,
    TenantLimits,
    tenant_of,
    tenant_of_call,
)
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

# -- unit ---------------------------------------------------------------------------------------


def test_tenant_names_are_fingerprints():
    assert tenant_of("", None) == DEFAULT_TENANT
    salt = tenant_of("acme-secret-salt")
    assert salt.startswith("salt:") and "acme" not in salt
    assert tenant_of("", "Bearer sk-1") == tenant_of("", "Bearer  sk-1 ") != tenant_of("", "x")
    assert tenant_of("s", "Bearer k") == tenant_of("s")  # the salt wins


class _Call:
    def __init__(self, *metadata: tuple[str, str]) -> None:
        self._metadata = metadata

    def invocation_metadata(self):
        return self._metadata


def test_a_replica_charges_the_tenant_its_router_names():
    # Behind a router every call carries the router's key: the router names the tenant it
    # counted (its client's salt or key fingerprint) and the replica charges that one.
    router_key = ("authorization", "Bearer router-key")
    named = ("x-prefixmesh-tenant", tenant_of("", "Bearer client-1"))
    assert tenant_of_call("", _Call(router_key, named), forwarded=True) == named[1]
    assert tenant_of_call("", _Call(router_key), forwarded=True) == tenant_of("", router_key[1])
    # A router itself (forwarded=False) never takes a client's word for it, and an oversized
    # name is ignored.
    assert tenant_of_call("", _Call(router_key, named)) == tenant_of("", router_key[1])
    huge = ("x-prefixmesh-tenant", "x" * 65)
    assert tenant_of_call("s", _Call(router_key, huge), forwarded=True) == tenant_of("s")


def test_limiter_caps_concurrency_and_queued_tokens_and_counts_rejections():
    registry = CollectorRegistry()
    limiter = TenantLimiter(TenantLimits(2, 100), registry)
    a1, a2 = limiter.admit("a"), limiter.admit("a")
    with pytest.raises(TenantBusy, match="2 requests in flight"):
        limiter.admit("a")
    b = limiter.admit("b")  # another tenant is not affected
    a1.queue_tokens(80)
    with pytest.raises(TenantBusy, match="80 prompt tokens queued"):
        a2.queue_tokens(30)
    assert limiter.concurrent == {"a": 1, "b": 1}  # the refused ticket was closed
    b.queue_tokens(500)  # a lone request over the cap still runs (else it never could)
    a1.started()
    a3 = limiter.admit("a")
    a3.queue_tokens(90)  # a1's tokens left the queue when it started
    for ticket in (a1, a3, b, b):  # close is idempotent
        ticket.close()
    assert limiter.concurrent == {} and limiter.queued_tokens == {}
    text = generate_latest(registry).decode()
    assert 'prefixmesh_tenant_rejections_total{reason="concurrent",tenant="a"} 1.0' in text
    assert 'prefixmesh_tenant_rejections_total{reason="queued_tokens",tenant="a"} 1.0' in text


# -- real processes -------------------------------------------------------------------------------

CAP = 2


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[MiniCluster]:
    caps = ("--tenant-max-concurrent", str(CAP), "--tenant-max-queued-tokens", "4000")
    c = start_mini_cluster(
        str(tiny_model_dir), replica_args=caps, router_args=caps, namespace="ten"
    )
    yield c
    c.stop()


async def _burst(address: str, salts: list[str], by_key: bool = False) -> list[grpc.StatusCode]:
    """One request per entry at once; ``by_key``: the entry is the caller's bearer token (an
    API-key tenant, no cache_salt) instead of its cache_salt."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GeneratorStub(ch)

        async def one(i: int, salt: str) -> grpc.StatusCode:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5 + i] * 24), cache_salt="" if by_key else salt,
                sampling=pb.SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
            )  # fmt: skip
            metadata = (("authorization", f"Bearer {salt}"),) if by_key else None
            try:
                async for _ in stub.Generate(request, timeout=120, metadata=metadata):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        return await asyncio.gather(*(one(i, s) for i, s in enumerate(salts)))


@pytest.mark.cluster
@pytest.mark.parametrize("target", ["replica", "router"])
def test_flooding_tenant_is_capped_and_the_other_is_served(cluster: MiniCluster, target: str):
    address = cluster.replica_grpc if target == "replica" else cluster.router_grpc
    salts = ["flood"] * 8 + ["calm"] * CAP
    codes = asyncio.run(_burst(address, salts))
    flood, calm = codes[:8], codes[8:]
    assert calm == [grpc.StatusCode.OK] * CAP, calm  # within its own cap: never refused
    assert set(flood) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, flood
    assert flood.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 8 - CAP, flood
    http = cluster.replica_http if target == "replica" else cluster.router_http
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    flood_tenant = tenant_of("flood")
    line = f'prefixmesh_tenant_rejections_total{{reason="concurrent",tenant="{flood_tenant}"}}'
    assert line in metrics, metrics[-2000:]
    assert tenant_of("calm") not in metrics.split("prefixmesh_tenant_rejections_total", 1)[1]
    state = cluster.wait_idle()
    assert state.integrity_ok, state.integrity_error


@pytest.mark.cluster
def test_api_key_tenants_behind_the_router_are_told_apart_by_the_replica(cluster: MiniCluster):
    # No cache_salt: the tenant is the caller's key. The replica sees every call with the
    # router's credentials, so only the tenant the router names (x-prefixmesh-tenant) keeps
    # the calm tenant's requests clear of the flood's share of the replica's caps.
    keys = ["flood-key"] * 8 + ["calm-key"] * CAP
    codes = asyncio.run(_burst(cluster.router_grpc, keys, by_key=True))
    flood, calm = codes[:8], codes[8:]
    assert calm == [grpc.StatusCode.OK] * CAP, calm
    assert flood.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 8 - CAP, flood
    with urllib.request.urlopen(f"http://{cluster.replica_http}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert (
        tenant_of("", "Bearer calm-key")
        not in metrics.split("prefixmesh_tenant_rejections_total", 1)[1]
    )
    state = cluster.wait_idle()
    assert state.integrity_ok, state.integrity_error


def test_the_router_names_a_tenant_only_where_the_replica_would_find_another():
    # router/forward.py's upstream metadata: with or without the tenant's name, the replica
    # charges the tenant the router counted, for every salt, client key and router key.
    from prefixmesh.auth import bearer_metadata
    from router.forward import upstream_metadata

    for salt in ("", "s"):
        for client in (None, "client-key"):
            for router_key in ("", "router-key"):
                own = bearer_metadata(router_key) or None
                client_md = (("authorization", f"Bearer {client}"),) if client else ()
                tenant = tenant_of_call(salt, _Call(*client_md))
                sent = upstream_metadata(own, tenant, salt)
                assert tenant_of_call(salt, _Call(*(sent or ())), forwarded=True) == tenant
                named = any(key == "x-prefixmesh-tenant" for key, _ in sent or ())
                assert named == (not salt and bool(client or router_key))
