"""router/discovery.py units: how the router reports a replica whose model info it cannot get."""

from __future__ import annotations

import asyncio
import logging

import grpc

from proto import prefixmesh_pb2 as pb
from router.discovery import Lease, ReplicaHandle, ReplicaView


class _FlakyAdmin:
    """A Replica stub whose GetModelInfo fails with ``codes`` in turn, then answers."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)
        self.calls = 0

    async def GetModelInfo(self, request, timeout=None, metadata=None):  # noqa: N802
        self.calls += 1
        if self.codes:
            code = self.codes.pop(0)
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
        return pb.ModelInfo(model="echo")


def _handle(admin: _FlakyAdmin) -> ReplicaHandle:
    lease = Lease(address="127.0.0.1:1", model="echo", block_size=16, epoch="e1")
    return ReplicaHandle("r1", lease, channel=None, generator=None, admin=admin)  # type: ignore[arg-type]


def test_a_failing_model_info_call_is_logged_once_until_it_answers(caplog):
    unavailable, deadline = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED
    admin = _FlakyAdmin(unavailable, unavailable, unavailable, deadline, deadline)
    handle, view = _handle(admin), ReplicaView()

    async def rounds(n: int) -> None:
        for _ in range(n):  # one call per discovery round
            await view._load_tokenizer(handle, handle.lease.group)

    with caplog.at_level(logging.WARNING, logger="prefixmesh.router"):
        asyncio.run(rounds(6))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # Five failed rounds, two kinds of failure: two lines. The sixth round succeeds.
    assert admin.calls == 6 and len(warnings) == 2
    assert "UNAVAILABLE" in warnings[0] and "DEADLINE_EXCEEDED" in warnings[1]
    assert view.model_ids[handle.lease.group] == "echo"
    # Answered once: a new failure is news again.
    admin.codes = [unavailable]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefixmesh.router"):
        asyncio.run(rounds(1))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
