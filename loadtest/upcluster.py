"""A whole ``prefixmesh up`` cluster as a subprocess, for benchmarks that need to kill its parts.

Starts ``prefixmesh up`` with its defaults plus the given flags, waits until the router lists
every replica, and reads each child's pid from ``up``'s own log lines (``started replica-1 (pid
N)``), so a benchmark can ``kill -9`` a replica, Redis or the router as an operator would and
watch ``up`` bring it back. Torch-free (the children import torch, not this process).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from prefixmesh.ports import free_ports
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


class UpCluster:
    """``prefixmesh up --replicas N --model M <flags>`` on free loopback ports."""

    def __init__(self, model: str, replicas: int, flags: tuple[str, ...] = ()) -> None:
        self.model, self.replicas, self.flags = model, replicas, flags
        self.port, self.http_port = free_ports(2)
        self.router = f"127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="up-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 600.0) -> None:
        # A clean environment: settings of the caller's own cluster must not leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXMESH_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefixmesh.cli", "up", "--replicas", str(self.replicas),
                 "--model", self.model, "--port", str(self.port),
                 "--http-port", str(self.http_port), "--no-color", *self.flags],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while "prefixmesh is up" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefixmesh up exited:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"prefixmesh up not ready:\n{self.log()[-3000:]}")
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid(self, name: str) -> int:
        """The pid of the latest instance of child ``name`` (``replica-0``, ``redis``, ...)."""
        found = re.findall(rf"started {re.escape(name)} \(pid (\d+)\)", self.log())
        if not found:
            raise KeyError(f"no child named {name!r} in the up log")
        return int(found[-1])

    def kill(self, name: str) -> int:
        """``kill -9`` the child ``name``; returns its pid."""
        pid = self.pid(name)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return pid

    def cache_states(self, timeout_s: float = 60.0) -> dict[str, pb.CacheState]:
        """Every listed replica's cache state once none runs a request or holds a block (or
        the latest one seen, after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, pb.CacheState] = {}
        while True:
            try:
                with grpc.insecure_channel(self.router) as ch:
                    listed = pb_grpc.ClusterStub(ch).ListReplicas(pb.Empty(), timeout=5)
                for info in listed.replicas:
                    with grpc.insecure_channel(info.address) as ch:
                        states[info.replica_id] = pb_grpc.ReplicaStub(ch).GetCacheState(
                            pb.Empty(), timeout=10
                        )
                idle = all(s.inflight_requests == 0 and s.used_blocks == 0 for s in states.values())
                if len(states) >= self.replicas and idle:
                    return states
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                return states
            time.sleep(0.5)

    def stop(self, timeout_s: float = 90.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
