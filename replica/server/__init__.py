"""The replica's server part: one engine behind gRPC, registered in Redis.

``replica/`` holds the engine (importable without grpc or Redis); this package wraps it for the
network: ``server`` (process lifecycle), ``servicers`` (the gRPC methods), ``engine_loop`` (the
thread that owns the engine), ``request_mapping`` (wire <-> engine), ``kv_publisher`` (Redis
lease and block events), ``metrics`` (Prometheus) and ``config`` (flags and environment).
Peer KV fetch, both sides of it, lives in ``replica/fetch/``.
``python -m replica.server`` and ``prefixmesh replica`` start one.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``prefixmesh replica``: imported lazily so that importing a submodule stays light."""
    from kernels.cpu_flags import cap_torch

    cap_torch()  # under PREFIXMESH_CPU_ISA, torch's own kernels follow the cap too
    from replica.server.server import main as server_main

    return server_main(argv)
