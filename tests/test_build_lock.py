"""The C++ kernels' build lock dies with its holder (kernels/build_lock.py, issue 48).

A builder killed mid-build used to leave torch's ``lock`` file behind, and every later start
waited on it, silently, for 15 minutes. Here: a lock held by a live process makes a waiter say
so with the time waited and is free the moment the holder is killed; a replica killed with
kill -9 in the middle of its kernel build, and a whole ``prefixmesh up`` killed the same way,
leave nothing that makes the next start wait; a finished build is never built again.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from helpers import Proc, free_port
from test_up import CLI, ROOT, _descendants, _wait_listed

from kernels import cpu_ops
from kernels.build_lock import BuildLock
from prefixmesh.procs import wait_serving
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

HOLD = (
    "import sys, time; from pathlib import Path; from kernels.build_lock import BuildLock; "
    "lock = BuildLock(Path(sys.argv[1])); lock.acquire(); print('held', flush=True); "
    "time.sleep(600)"
)


def test_a_waiter_logs_its_wait_and_gets_the_lock_when_the_holder_is_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "prefixmesh_cpu_ops_x"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        folder.mkdir()
        (folder / "lock").write_text("")  # what torch's builder leaves when killed
        waiter = BuildLock(folder, poll_s=0.05)
        caplog.set_level(logging.INFO, logger="kernels.build_lock")
        thread = threading.Thread(target=waiter.acquire)
        thread.start()
        time.sleep(1.5)
        assert thread.is_alive(), "acquired a lock a live process holds"
        waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert waits and f"pid {holder.pid} holds" in waits[0], waits
        killed_at = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - killed_at < 2.0
        assert 1.0 < waiter.waited_s < 10.0
        assert not (folder / "lock").exists(), "the dead builder's torch lock is still there"
        assert waiter.path.read_text() == str(os.getpid())
        waiter.release()
    finally:
        holder.kill()
        holder.wait()


def _build_folder(kernel_dir: Path, isa: str) -> Path:
    return kernel_dir / cpu_ops.build_name(isa)[0]


def _wait_for_compile(folder: Path, alive, timeout: float = 300) -> None:  # noqa: ANN001
    """Until torch's builder has started compiling into ``folder`` (its lock file is there)."""
    deadline = time.monotonic() + timeout
    while not (folder / "lock").exists():
        assert alive(), "the process exited before its kernel build started"
        assert time.monotonic() < deadline, f"no build started in {folder}"
        time.sleep(0.1)
    time.sleep(2.0)  # well inside the compile, which takes a minute or more


def _kernel_build(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        info = pb_grpc.ReplicaStub(channel).GetModelInfo(pb.Empty(), timeout=10)
    return info.kernel_build


def _replica(name: str, model: Path, port: int, env: dict[str, str]) -> Proc:
    return Proc.cli(name, "replica", "--model", str(model), "--port", str(port),
                    "--threads", "1", "--dtype", "float32", "--max-model-len", "256",
                    "--num-blocks", "32", env=env)  # fmt: skip


@pytest.mark.cluster
def test_replica_killed_mid_build_does_not_make_the_next_wait(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    env = {"PREFIXMESH_KERNEL_DIR": str(tmp_path / "k"), "PREFIXMESH_CPU_ISA": "generic"}
    folder = _build_folder(tmp_path / "k", "generic")
    first = _replica("first", tiny_model_dir, free_port(), env)
    try:
        _wait_for_compile(folder, first.alive)
        os.killpg(first.proc.pid, signal.SIGKILL)  # kill -9: the replica and its compiler
        first.proc.wait(30)
    finally:
        first.stop(signal.SIGKILL)
    assert (folder / "lock").exists()  # the leftover that used to hang every later start
    port = free_port()
    second = _replica("second", tiny_model_dir, port, env)
    try:
        second.wait_serving(f"127.0.0.1:{port}", timeout=600)
        logs = second.logs(100_000)
        assert (
            "on another process's build" not in logs and "removing a dead builder's lock" in logs
        ), logs
        assert _kernel_build(f"127.0.0.1:{port}") == "cpu_ops generic (built)"
    finally:
        second.stop()
    port = free_port()
    third = _replica("third", tiny_model_dir, port, env)  # never builds a finished build again
    try:
        third.wait_serving(f"127.0.0.1:{port}", timeout=120)
        assert _kernel_build(f"127.0.0.1:{port}") == "cpu_ops generic (prebuilt)"
        assert "building CPU kernels" not in third.logs(100_000)
    finally:
        third.stop()


def _up(model: Path, port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            [*CLI, "up", "--replicas", "2", "--model", str(model), "--port", str(port),
             "--http-port", str(free_port()), "--grace-period", "10"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip


def _kill_tree(proc: subprocess.Popen) -> None:
    """kill -9 of ``proc`` and everything under it at once, as when a pod is stopped."""
    for pid in _descendants(proc.pid) | {proc.pid}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


@pytest.mark.cluster
def test_up_killed_mid_build_does_not_make_the_next_up_wait(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXMESH_")}
    env = base | {"PREFIXMESH_KERNEL_DIR": str(tmp_path / "k"), "PREFIXMESH_CPU_ISA": "avx2"}
    if cpu_ops.build_isa("avx2") != "avx2":
        env["PREFIXMESH_CPU_ISA"] = "generic"  # not an x86 machine: its one build
    folder = _build_folder(tmp_path / "k", env["PREFIXMESH_CPU_ISA"])
    log = tmp_path / "up.log"
    up = _up(tiny_model_dir, free_port(), env, log)
    try:
        _wait_for_compile(folder, lambda: up.poll() is None)
    finally:
        _kill_tree(up)
    assert (folder / "lock").exists()
    killed = log.stat().st_size
    port = free_port()
    up = _up(tiny_model_dir, port, env, log)
    try:
        wait_serving(f"127.0.0.1:{port}", 600, alive=lambda: up.poll() is None)
        assert len(_wait_listed(f"127.0.0.1:{port}", 2, timeout_s=600)) == 2
        text = log.read_text(errors="replace")[killed:]
        assert "removing a dead builder's lock" in text, text[-3000:]
        # Its two replicas: one builds, the other says it waits on that live build.
        assert "on another process's build of" in text, text[-3000:]
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            _kill_tree(up)
