"""``prefixmesh replica``: one engine behind gRPC (grpc.aio on uvloop), registered in Redis.

Serves ``Generator`` (streaming generation) and ``Replica`` (load, stats, model info, cache
state), plus standard health checking and server reflection. The engine runs on its own thread
(``EngineLoop``); the ``KVPublisher`` keeps the lease, load and block set in Redis exact. With
``--api-key`` every call but health and reflection needs ``authorization: Bearer <key>``
(routers send it: their ``--replica-api-key``, else their ``--api-key``).

Admission: a request waits (is admitted but has produced nothing yet) in a bounded queue of
``--max-queue``; beyond it ``Generate`` answers RESOURCE_EXHAUSTED at once so a router can go
elsewhere. Cancellation or an expired deadline aborts the request and frees its blocks.

SIGTERM / SIGINT: health goes NOT_SERVING and new requests get UNAVAILABLE, the replica leaves
Redis (routers stop sending here), in-flight requests get ``--grace-period`` seconds to finish,
then the rest are aborted and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixmesh import event_loop
from prefixmesh.auth import ApiKeyInterceptor
from prefixmesh.grpc_guard import DecodeGuardInterceptor
from prefixmesh.hashing import HASH_SCHEME
from prefixmesh.limits import RequestLimits
from prefixmesh.tenants import TenantLimiter, TenantLimits
from prefixmesh.tls import TlsFiles
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc
from replica.fetch.client import FetchConfig, PeerFetcher, RedisHolders
from replica.fetch.holder import BlockService
from replica.fetch.layout import KVLayout
from replica.fetch.warm_start import warm_start
from replica.server.admission import Admission
from replica.server.config import ServerConfig, parse_config
from replica.server.engine_loop import EngineLoop
from replica.server.kernel_report import kernel_build
from replica.server.kv_publisher import KVEventBuffer, KVPublisher
from replica.server.metrics import ReplicaMetrics
from replica.server.servicers import GeneratorService, ReplicaService, ServedModel
from replica.server.zmq_events import ZmqEventPublisher, engine_callback

if TYPE_CHECKING:
    from prefixmesh.openai.http import OpenAIHttpServer
    from replica.engine import LLMEngine

log = logging.getLogger("prefixmesh.replica")

_GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second replica on a taken port must fail, not share it
]


class ReplicaServer:
    """One replica process: engine thread, gRPC server, Redis publisher and metrics."""

    def __init__(self, config: ServerConfig, engine: LLMEngine) -> None:
        self.config = config
        self.engine = engine
        self.replica_id = config.replica_id
        self.limits = RequestLimits.from_config(config)  # prefixmesh/limits.py
        self.tls = TlsFiles.from_config(config)  # prefixmesh/tls.py
        self.tenants: TenantLimiter | None = None  # prefixmesh/tenants.py, set in start()
        self.address = ""
        self.port = 0
        self.admission = Admission(config.max_queue)
        self._stopped = asyncio.Event()
        self._force = asyncio.Event()  # a second signal: skip the rest of the grace period
        self.loop: EngineLoop | None = None
        self.publisher: KVPublisher | None = None
        self.zmq_events: ZmqEventPublisher | None = None  # --kv-events
        self.metrics: ReplicaMetrics | None = None
        self.metrics_port = 0
        self.http: OpenAIHttpServer | None = None  # when --http-port is set
        self.warm_start: asyncio.Task[int] | None = None  # --warm-start-share
        self.http_address = ""
        self.fetcher: PeerFetcher | None = None  # fetch-on-miss, unless --no-fetch
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def _kv_callback(self, buffer: KVEventBuffer) -> Callable[[list[bytes], list[bytes]], None]:
        """Redis' buffer, plus the vLLM-format ZMQ publisher where ``--kv-events`` is set."""
        if not self.config.kv_events:
            return buffer.append
        self.zmq_events = ZmqEventPublisher(self.config.kv_events)
        bm = self.engine.block_manager
        to_zmq = engine_callback(self.zmq_events, bm.cached_block, bm.block_size)
        log.info("publishing vLLM-format KV events on %s (replay %s)",
                 self.zmq_events.endpoint, self.zmq_events.replay)  # fmt: skip

        def both(stored: list[bytes], removed: list[bytes]) -> None:
            buffer.append(stored, removed)
            to_zmq(stored, removed)

        return both

    async def start(self) -> None:
        cfg = self.config
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop())
        buffer = KVEventBuffer()
        self.engine.set_kv_event_callback(self._kv_callback(buffer))

        # -- API key (prefixmesh/auth.py): every gRPC call but health and reflection --
        interceptors = [ApiKeyInterceptor(cfg.api_key)] if cfg.api_key else []
        interceptors.append(DecodeGuardInterceptor())  # undecodable body: INVALID_ARGUMENT
        server = grpc.aio.server(
            interceptors=interceptors, options=_GRPC_OPTIONS + self.limits.grpc_options()
        )
        self.port = self.tls.add_port(server, f"{cfg.host}:{cfg.port}")
        if not self.port:
            raise SystemExit(f"prefixmesh replica: cannot bind {cfg.host}:{cfg.port}")
        self.replica_id = cfg.resolved_replica_id(self.port)  # may name the bound port
        self.address = cfg.resolved_advertise_address(self.port)
        self._server = server

        self.metrics = ReplicaMetrics(
            lambda: self.loop.stats if self.loop else None, self.engine.model_id, self.replica_id
        )
        if cfg.metrics_port:
            self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.host)
        tenant_limits = TenantLimits.from_config(cfg)
        if tenant_limits.enabled:
            self.tenants = TenantLimiter(tenant_limits, self.metrics.registry)
        services = self._add_services(server, self.loop, self.metrics)

        self.loop.start()
        await server.start()
        if cfg.http_port:  # -- OpenAI HTTP front door (prefixmesh/openai/) --
            self.http = await self._open_front_door()
            self.http_address = f"{self.address.rsplit(':', 1)[0]}:{self.http.port}"
        if cfg.redis:
            self.publisher = KVPublisher(
                cfg.redis,
                self.replica_id,
                self._lease_fields(),
                self._load_fields,
                lambda: self.loop.call(lambda eng: buffer.cut(eng.cached_block_hashes)),
                buffer,
                namespace=cfg.namespace,
            )
            self.publisher.start()
        for name in ("", *services):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cfg.warm_start_share > 0 and self.fetcher is not None and self.fetcher.holders:
            # After SERVING: readiness never waits for it (replica/fetch/warm_start.py).
            self.warm_start = asyncio.ensure_future(
                warm_start(self.fetcher, self.engine.block_manager.num_blocks,
                           cfg.warm_start_share)
            )  # fmt: skip
        log.info(
            "replica %s serving %s (%s, kernels: %s) on %s:%d (advertised %s)%s",
            self.replica_id,
            self.engine.model_id,
            str(self.engine.dtype).removeprefix("torch."),
            kernel_build(self.engine),
            cfg.host,
            self.port,
            self.address,
            f", metrics on :{self.metrics_port}" if self.metrics_port else "",
        )

    def _add_services(
        self, server: grpc.aio.Server, loop: EngineLoop, metrics: ReplicaMetrics
    ) -> tuple[str, ...]:
        """Mount the servicers, health and reflection; returns the served service names."""
        engine = self.engine
        model = ServedModel(
            replica_id=self.replica_id,
            model_id=engine.model_id,
            block_size=engine.block_size,
            max_model_len=engine.max_model_len,
            vocab_size=int(engine.model_config.vocab_size),
            tokenizer=engine.tokenizer,
            kernel_build=kernel_build(engine),
            dtype=str(engine.dtype).removeprefix("torch."),
        )
        layout = KVLayout(engine.model_id, model.dtype, engine.block_size)
        if self.config.fetch:
            self.fetcher = self._peer_fetcher(loop, layout, metrics)
        generator = GeneratorService(
            loop, self.admission, model, metrics, self.limits, self.tenants, self.fetcher
        )
        blocks = BlockService(loop, engine.runner.kv_caches, layout, metrics)
        replica = ReplicaService(loop, self.admission, model, self._epoch, blocks, self.fetcher)
        pb_grpc.add_GeneratorServicer_to_server(generator, server)
        pb_grpc.add_ReplicaServicer_to_server(replica, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        services = (
            pb.DESCRIPTOR.services_by_name["Generator"].full_name,
            pb.DESCRIPTOR.services_by_name["Replica"].full_name,
        )
        reflection.enable_server_reflection(
            (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        return services

    def _peer_fetcher(
        self, loop: EngineLoop, layout: KVLayout, metrics: ReplicaMetrics
    ) -> PeerFetcher:
        """Fetch-on-miss: peers come from the request's hint, or from Redis when there is one."""
        from replica.model_runner import kv_bytes_per_block

        cfg, engine = self.config, self.engine
        mc = engine.model_config
        holders = None
        if cfg.redis:
            holders = RedisHolders(cfg.redis, cfg.namespace, self.replica_id, layout)
        fetch = FetchConfig(
            timeout_s=cfg.fetch_timeout,
            min_blocks=cfg.fetch_min_blocks,
            bytes_per_s=cfg.fetch_mb_per_s * 1e6,
            prefill_tokens_per_s=cfg.fetch_prefill_tokens_per_s,
        )
        return PeerFetcher(
            loop, layout, (engine.block_size, mc.num_kv_heads, mc.head_dim), mc.num_layers,
            engine.dtype, kv_bytes_per_block(mc, engine.block_size, engine.dtype), fetch,
            api_key=cfg.api_key, tls=self.tls, holders=holders, metrics=metrics,
        )  # fmt: skip

    async def _open_front_door(self) -> OpenAIHttpServer:
        """This replica's OpenAI door: its one model, ready while it serves and is not draining."""
        from prefixmesh.openai.doors import loopback, open_front_door  # aiohttp: only if asked
        from prefixmesh.openai.http import FrontDoor

        cfg, engine = self.config, self.engine

        def ready() -> tuple[bool, dict[str, Any]]:
            ok = self.loop is not None and not self.admission.draining
            return ok, {"replica_id": self.replica_id, "model": engine.model_id}

        door = FrontDoor(
            grpc_target=loopback(cfg.host, self.port),
            models=lambda: [engine.model_id],
            tokenizer=lambda: engine.tokenizer,
            ready=ready,
            registry=self.metrics.registry,
            api_key=cfg.api_key,
            limits=self.limits,
            tls=self.tls,
        )
        return await open_front_door(door, cfg.host, cfg.http_port)

    def _epoch(self) -> str:
        return self.publisher.epoch if self.publisher else ""

    async def shutdown(self) -> None:
        """Drain: stop admitting, leave Redis, let in-flight requests finish, then stop."""
        admission = self.admission
        if admission.draining:
            return
        admission.draining = True
        log.info(
            "shutting down: %d requests in flight, grace period %.1fs",
            admission.num_inflight,
            self.config.grace_period,
        )
        await self.health.enter_graceful_shutdown()
        if self.publisher is not None:
            await self.publisher.close(deregister=True)
        waits = [
            asyncio.ensure_future(admission.wait_idle()),
            asyncio.ensure_future(self._force.wait()),
        ]
        await asyncio.wait(
            waits, timeout=self.config.grace_period, return_when=asyncio.FIRST_COMPLETED
        )
        for w in waits:
            w.cancel()
        if admission.num_inflight:
            log.warning("aborting %d requests still in flight", admission.num_inflight)
        if self._server is not None:
            # Cancels the remaining streams: their handlers abort them in the engine.
            await self._server.stop(grace=0.5)
        if self.http is not None:
            await self.http.close()
        if self.warm_start is not None:
            self.warm_start.cancel()
        if self.fetcher is not None:
            await self.fetcher.close()
        if self.loop is not None:
            await asyncio.to_thread(self.loop.stop)
        if self.zmq_events is not None:
            self.zmq_events.close()
        if self.metrics is not None:
            self.metrics.close()
        self._stopped.set()

    def on_signal(self) -> None:
        """First SIGTERM/SIGINT drains gracefully; a second one cuts the grace period short."""
        if self.admission.draining:
            self._force.set()
        else:
            asyncio.ensure_future(self.shutdown())

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # -- what the Redis lease carries -----------------------------------------------------

    def _lease_fields(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "http_address": self.http_address,
            "model": self.engine.model_id,
            "block_size": self.engine.block_size,
            "hash_scheme": HASH_SCHEME,
            "max_model_len": self.engine.max_model_len,
            "metrics_port": self.metrics_port,
        }

    def _load_fields(self) -> dict[str, Any]:
        s = self.loop.stats
        return {
            "running": s.running,
            "waiting": s.waiting,
            "kv_usage": f"{s.kv_usage:.4f}",
            "queued_tokens": s.queued_tokens,
            "num_blocks": s.num_blocks,
            "free_blocks": s.free_blocks,
            "cached_blocks": s.cached_blocks,
            **self._fetch_fields(),
        }

    def _fetch_fields(self) -> dict[str, str]:
        """``fetch_cost``: what fetching a prompt token from a peer costs here against
        prefilling it (``FetchCost.token_cost``); absent when this replica does not fetch."""
        if self.fetcher is None:
            return {}
        per_token = self.fetcher.bytes_per_block / self.engine.block_size
        return {"fetch_cost": f"{self.fetcher.cost.token_cost(per_token):.5f}"}


# -- process entry point ------------------------------------------------------------------


async def serve(config: ServerConfig) -> None:
    """Load the engine, serve until SIGTERM/SIGINT, then drain and exit."""
    from replica.engine import LLMEngine  # torch: imported only by the replica process

    engine = await asyncio.to_thread(LLMEngine, config.engine_config())
    server = ReplicaServer(config, engine)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.on_signal)
    await server.wait_stopped()
    log.info("replica %s stopped", server.replica_id)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    event_loop.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
