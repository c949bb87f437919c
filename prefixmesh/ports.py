"""Free loopback TCP ports for the processes a command starts (``prefixmesh up``, the load
tester's clusters, the test harness)."""

from __future__ import annotations

import contextlib
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (the OS may hand it out again later; bind soon)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different TCP ports free right now. Each stays bound until all are picked:
    picked one at a time, a port closed a moment ago can come back for the next pick, and two
    processes of one cluster would then be told to bind the same port."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports
