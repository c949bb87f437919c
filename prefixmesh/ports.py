"""Free loopback TCP ports for the processes a command starts (``prefixmesh up``, the load
tester's clusters, the benchmarks, the test harness)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (the OS may hand it out again later; bind soon)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different TCP ports free right now (see :func:`port_picker`)."""
    with port_picker(host) as pick:
        return [pick() for _ in range(count)]


@contextlib.contextmanager
def port_picker(host: str = "127.0.0.1") -> Iterator[Callable[[], int]]:
    """``pick()`` returns a free port and keeps it bound until the block ends, so no two picks
    are the same: picked one at a time and released at once, a port closed a moment ago can
    come back for the next pick, and two processes of one cluster would be told to bind it."""
    with contextlib.ExitStack() as held:

        def pick() -> int:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            return int(s.getsockname()[1])

        yield pick
