"""``python -m prefixmesh.cli.healthcheck [host:port]``: exit 0 when a server's gRPC health
is SERVING.

For container health checks and Kubernetes exec probes, which (unlike kubelet's own gRPC probe)
can speak TLS: it dials ``127.0.0.1:$PREFIXMESH_PORT`` by default, over TLS when
``PREFIXMESH_TLS_CERT`` is set, trusting ``PREFIXMESH_TLS_CA`` (else the client CA, else the
certificate itself) and presenting the server's own certificate, which a replica that requires
client certificates (``PREFIXMESH_TLS_CLIENT_CA``) accepts. Torch-free.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixmesh.tls import TlsFiles, channel


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = os.environ.get
    target = argv[0] if argv else f"127.0.0.1:{env('PREFIXMESH_PORT', '50051')}"
    files = TlsFiles(
        env("PREFIXMESH_TLS_CERT", ""), env("PREFIXMESH_TLS_KEY", ""),
        env("PREFIXMESH_TLS_CLIENT_CA", ""), env("PREFIXMESH_TLS_CA", ""),
    ).loopback()  # fmt: skip
    try:
        with channel(target, files) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.RpcError as exc:
        print(f"{target}: {exc.code().name}", file=sys.stderr)
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
