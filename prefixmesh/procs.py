"""Child-process supervision for ``prefixmesh up``, the tests and the benchmarks: prefixed logs,
health waits, clean shutdown.

Each child runs in its own session (process group), so a Ctrl-C in the terminal reaches only
``up``, which then stops the children in order (router, replicas, Redis): SIGTERM to the group,
a grace period, then SIGKILL. On Linux children also get ``PR_SET_PDEATHSIG`` so that even a
SIGKILLed ``up`` leaves no orphans behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixmesh.tls import TlsFiles
from prefixmesh.tls import channel as tls_channel

# Colors in the order docker compose hands them out.
_COLORS = ("36", "33", "32", "35", "34", "96", "93", "92", "95", "94")
_RESET = "\033[0m"

_PR_SET_PDEATHSIG = 1
_libc_prctl: Callable[..., int] | None = None
if sys.platform.startswith("linux"):
    # Resolved now, not in the child: preexec_fn must not import or take locks.
    _libc_prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl


def _die_with_parent() -> None:
    if _libc_prctl is not None:
        _libc_prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """What to run: ``critical`` children (the router) take the cluster down when they die
    and are not restarted. ``env`` is set on top of the supervisor's own environment (or, with
    ``inherit_env=False``, is the whole environment); it may hold secrets (an API key stays out
    of ``argv``, which is logged and shown by ``ps``)."""

    name: str
    argv: Sequence[str]
    env: dict[str, str] | None = field(default=None, repr=False)
    critical: bool = False
    inherit_env: bool = True


@dataclass(slots=True)
class Child:
    """One running (or finished) instance of a spec."""

    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    started_at: float
    restarts: int = 0
    reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class LogSink:
    """Writes whole lines, prefixed ``name | `` like docker compose, from many threads."""

    out: IO[str] = field(default_factory=lambda: sys.stdout)
    color: bool = False
    width: int = 10
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _colors: dict[str, str] = field(default_factory=dict)

    def line(self, name: str, text: str) -> None:
        prefix = f"{name:<{self.width}} |"
        if self.color:
            code = self._colors.setdefault(name, _COLORS[len(self._colors) % len(_COLORS)])
            prefix = f"\033[{code}m{prefix}{_RESET}"
        with self._lock:
            self.out.write(f"{prefix} {text.rstrip()}\n")
            self.out.flush()


class Supervisor:
    """Starts children, pumps their output into a LogSink, reports exits, stops them all."""

    def __init__(self, sink: LogSink, grace_s: float = 10.0) -> None:
        self.sink = sink
        self.grace_s = grace_s
        self.children: list[Child] = []
        self._reported: set[int] = set()

    def log(self, text: str) -> None:
        self.sink.line("up", text)

    def start(self, spec: ProcessSpec, restarts: int = 0) -> Child:
        env = {**(os.environ if spec.inherit_env else {}), **(spec.env or {})}
        env.setdefault("PYTHONUNBUFFERED", "1")  # so log lines arrive as they are written
        proc = subprocess.Popen(
            list(spec.argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (only calls an already-resolved prctl)
        )
        child = Child(spec=spec, proc=proc, started_at=time.monotonic(), restarts=restarts)
        child.reader = threading.Thread(
            target=self._pump, args=(child,), name=f"log-{spec.name}", daemon=True
        )
        child.reader.start()
        self.children.append(child)
        self.log(f"started {spec.name} (pid {proc.pid}): {shlex.join(spec.argv)}")
        return child

    def _pump(self, child: Child) -> None:
        assert child.proc.stdout is not None
        for raw in child.proc.stdout:
            self.sink.line(child.name, raw.decode("utf-8", errors="replace"))

    def exited(self) -> list[Child]:
        """Children that exited since the last call (each reported once)."""
        out = []
        for child in self.children:
            if not child.alive() and child.pid not in self._reported:
                self._reported.add(child.pid)
                if child.reader is not None:
                    child.reader.join(timeout=1.0)  # flush its last lines before the report
                out.append(child)
        return out

    def shutdown(self, order: Sequence[Sequence[str]] = ()) -> list[str]:
        """Stop every child: groups of names in ``order`` first (one group at a time), then
        the rest. Returns the names that had to be SIGKILLed."""
        remaining = [c for c in self.children if c.alive()]
        groups: list[list[Child]] = []
        for names in order:
            groups.append([c for c in remaining if c.name in names])
        named = {id(c) for g in groups for c in g}
        groups.append([c for c in remaining if id(c) not in named])
        killed: list[str] = []
        for group in groups:
            killed += self._stop_group(group)
        for child in self.children:
            if child.reader is not None:
                child.reader.join(timeout=1.0)
        return killed

    def _stop_group(self, group: list[Child]) -> list[str]:
        live = [c for c in group if c.alive()]
        for child in live:
            self.log(f"stopping {child.name} (pid {child.pid})")
            _signal_group(child.proc, signal.SIGTERM)
        # Polled, not one long wait: grace_s may drop to 0 meanwhile (a second Ctrl-C).
        started = time.monotonic()
        while any(c.alive() for c in live) and time.monotonic() - started < self.grace_s:
            time.sleep(0.05)
        killed = []
        for child in live:
            if child.alive():
                self.log(f"{child.name} ignored SIGTERM for {self.grace_s:.0f}s: SIGKILL")
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()
                killed.append(child.name)
            # The group may hold grandchildren that outlived their parent.
            _signal_group(child.proc, signal.SIGKILL)
        return killed


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def wait_serving(
    address: str,
    timeout_s: float,
    alive: Callable[[], bool] = lambda: True,
    stop: threading.Event | None = None,
    tls: TlsFiles | None = None,
) -> None:
    """Poll grpc.health.v1 on ``address`` until it reports SERVING.

    Raises RuntimeError if ``alive()`` turns false (the process died) or ``stop`` is set, and
    TimeoutError after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    with tls_channel(address, tls) as channel:  # plaintext without tls.ca
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if stop is not None and stop.is_set():
                raise RuntimeError("interrupted")
            if not alive():
                raise RuntimeError(f"the process serving {address} exited")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f}s")
            time.sleep(0.2)
