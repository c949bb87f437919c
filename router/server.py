"""``prefixmesh router``: the KV-cache-aware router's gRPC server.

Serves ``prefixmesh.v1.Generator`` (the replica's API, so clients talk to either) and
``prefixmesh.v1.Cluster`` (live replicas, their load and prefix hit rates, routing decisions),
plus standard health checking and reflection. Torch-free: a test checks that importing this
module never imports torch.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixmesh import event_loop
from prefixmesh.auth import ApiKeyInterceptor
from prefixmesh.grpc_guard import GuardedServer
from prefixmesh.limits import RequestLimits
from prefixmesh.openai.doors import loopback, open_front_door
from prefixmesh.openai.http import FrontDoor, OpenAIHttpServer
from prefixmesh.tenants import TenantLimiter, TenantLimits
from prefixmesh.tls import TlsFiles
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig, parse_config
from router.forward import Forwarder
from router.metrics import RouterMetrics
from router.policy import POLICIES
from router.routing import Router

if TYPE_CHECKING:  # the tokenizer loads lazily, on the first replica of a model
    from prefixmesh.tokenizer import Tokenizer

log = logging.getLogger("prefixmesh.router")


class GeneratorServicer(pb_grpc.GeneratorServicer):
    """``Generate`` routed to a replica, streamed back with failover."""

    def __init__(self, forwarder: Forwarder) -> None:
        # The forwarder is the handler itself (a coroutine writing each message): no extra hop.
        self.Generate = forwarder.generate  # type: ignore[method-assign]


class ClusterServicer(pb_grpc.ClusterServicer):
    """The router's view of the cluster and its routing statistics."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def state(self) -> pb.ClusterState:
        router = self.router
        live = {h.replica_id for h in router.view.live()}
        replicas = []
        for h in sorted(router.view.handles.values(), key=lambda h: h.replica_id):
            if h.replica_id not in live:
                continue
            lease, stats = h.lease, h.stats
            replicas.append(
                pb.ReplicaInfo(
                    replica_id=h.replica_id,
                    address=lease.address,
                    http_address=lease.http_address,
                    model=lease.model,
                    block_size=lease.block_size,
                    epoch=lease.epoch,
                    load=pb.ReplicaLoad(
                        replica_id=h.replica_id,
                        running=lease.running,
                        waiting=lease.waiting,
                        kv_usage=lease.kv_usage,
                        queued_tokens=lease.queued_tokens,
                        num_blocks=lease.num_blocks,
                    ),
                    requests=stats.requests,
                    prompt_tokens=stats.prompt_tokens,
                    cached_tokens=stats.cached_tokens,
                    hit_rate=stats.cached_tokens / stats.prompt_tokens
                    if stats.prompt_tokens
                    else 0.0,
                    inflight_tokens=max(0, h.inflight_tokens) + h.other_inflight_tokens,
                    cached_blocks=lease.cached_blocks,
                )  # fmt: skip
            )
        w = router.metrics.window
        routing = pb.RoutingStats(
            decisions=dict(w.decisions),
            requests=w.requests,
            predicted_cached_tokens=w.predicted_cached_tokens,
            actual_cached_tokens=w.actual_cached_tokens,
            prompt_tokens=w.prompt_tokens,
            retries=w.retries,
            failovers=w.failovers,
            errors=w.errors,
            hit_rate=w.hit_rate,
            misses=router.attribution.snapshot(),
        )
        return pb.ClusterState(
            policy=router.policy.name,
            replicas=replicas,
            routing=routing,
            redis_connected=router.redis_ok,
            router_id=router.router_id,
        )

    async def ListReplicas(self, request: pb.Empty, context) -> pb.ClusterState:  # noqa: N802
        return self.state()

    async def SetPolicy(self, request: pb.SetPolicyRequest, context) -> pb.ClusterState:  # noqa: N802
        if request.policy not in POLICIES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"policy must be one of {', '.join(POLICIES)} (got {request.policy!r})",
            )
        self.router.set_policy(request.policy)
        log.info("policy set to %s", request.policy)
        return self.state()

    async def ResetStats(self, request: pb.Empty, context) -> pb.ClusterState:  # noqa: N802
        self.router.metrics.reset_window()
        self.router.attribution.reset()
        for handle in self.router.view.handles.values():
            handle.stats.requests = handle.stats.prompt_tokens = handle.stats.cached_tokens = 0
        return self.state()


class RouterServer:
    """The router process's pieces wired together; ``start`` binds, ``stop`` cleans up."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.router = Router(config, self.metrics)
        # -- limits, tenants and TLS (prefixmesh/limits.py, tenants.py, tls.py) --
        self.limits = RequestLimits.from_config(config)
        self.tls = TlsFiles.from_config(config)
        self.router.view.tls = self.tls  # the replica channels: --tls-ca, own cert for mTLS
        tenant_limits = TenantLimits.from_config(config)
        self.tenants = (
            TenantLimiter(tenant_limits, self.metrics.registry) if tenant_limits.enabled else None
        )
        # -- API key (prefixmesh/auth.py): every gRPC call but health and reflection --
        # The decode guard (undecodable body: INVALID_ARGUMENT) is put on each handler as it is
        # registered (GuardedServer, in start), not run as an interceptor on every call.
        interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else None
        self.server = grpc.aio.server(interceptors=interceptors, options=self.limits.grpc_options())
        self.port = 0
        self.health = health.aio.HealthServicer()
        self.http: OpenAIHttpServer | None = None

    async def start(self) -> int:
        guarded = GuardedServer(self.server)
        pb_grpc.add_GeneratorServicer_to_server(
            GeneratorServicer(Forwarder(self.router, self.limits, self.tenants)), guarded
        )
        pb_grpc.add_ClusterServicer_to_server(ClusterServicer(self.router), guarded)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, guarded)
        names = (
            pb.DESCRIPTOR.services_by_name["Generator"].full_name,
            pb.DESCRIPTOR.services_by_name["Cluster"].full_name,
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        self.port = self.tls.add_port(self.server, f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise SystemExit(
                f"prefixmesh router: cannot bind {self.config.host}:{self.config.port}"
            )
        await self.router.start()
        await self.server.start()
        for name in ("", *names[:2]):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port, self.config.host)
        if self.config.http_port:  # -- OpenAI HTTP front door (prefixmesh/openai/doors.py) --
            self.http = await open_front_door(
                self.front_door(), self.config.host, self.config.http_port
            )
        log.info(
            "router %s on %s:%d, policy %s, redis %s", self.router.router_id,
            self.config.host, self.port, self.config.policy, self.config.redis,
        )  # fmt: skip
        return self.port

    def front_door(self) -> FrontDoor:
        """The router's OpenAI door: the models its live replicas serve, ready while any is."""
        view, router_id = self.router.view, self.router.router_id

        def models() -> list[str]:
            return sorted(set(view.model_ids.values()))

        def tokenizer() -> Tokenizer | None:
            return next((t for t in view.tokenizers.values() if t is not None), None)

        def ready() -> tuple[bool, dict[str, Any]]:
            live = len(view.live())
            return live > 0, {"replicas": live, "router_id": router_id}

        return FrontDoor(
            grpc_target=loopback(self.config.host, self.port),
            models=models,
            tokenizer=tokenizer,
            ready=ready,
            registry=self.metrics.registry,
            api_key=self.config.api_key,
            limits=self.limits,
            tls=self.tls,
        )

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.close()
        await self.server.stop(grace)
        await self.router.close()


async def serve(config: RouterConfig) -> None:
    server = RouterServer(config)
    await server.start()
    # The process's long-lived objects (modules, protobuf and gRPC state, the router's own) are
    # built: out of the collector's way, so a collection on the request path walks only what
    # requests allocate (a full one took ~27 ms in loadtest.router_bench before).
    gc.collect()
    gc.freeze()
    print(f"router listening on {config.host}:{server.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    event_loop.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
