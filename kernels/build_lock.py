"""A build lock that dies with its holder, for the C++ kernels' one-time compile.

torch's extension builder marks a build in progress with a ``lock`` file and makes every other
process wait for the file to go, without a time limit and without a word. A builder killed
mid-build (kill -9 of a starting replica, Ctrl-C during a first ``prefixmesh up``, a pod stopped
while starting) leaves that file behind, and every later start hangs on it.

:class:`BuildLock` is an ``fcntl.flock`` on a file beside the build folder: the kernel releases
it the moment its holder dies, however it dies. Whoever holds it is the only prefixmesh process
building that kernel, so a torch ``lock`` file found under it is left over from a dead builder
and is removed. A process that has to wait logs who it waits on, and for how long.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

# How often a waiting process says it is still waiting.
WAIT_LOG_EVERY_S = 10.0


@dataclass
class BuildLock:
    """Exclusive, process-wide lock on building ``build_dir`` (a context manager).

    ``waited_s`` is how long :meth:`acquire` waited on another process's build."""

    build_dir: Path
    poll_s: float = 0.2
    waited_s: float = 0.0
    _fd: int | None = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.build_dir.parent / f"{self.build_dir.name}.build-lock"

    def acquire(self) -> None:
        self.build_dir.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        start = time.monotonic()
        next_log = start
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= next_log:
                    log.warning(
                        "waiting %.0f s on another process's build of %s (pid %s holds %s)",
                        now - start, self.build_dir.name, _holder(fd), self.path,
                    )  # fmt: skip
                    next_log = now + WAIT_LOG_EVERY_S
                time.sleep(self.poll_s)
        self.waited_s = time.monotonic() - start
        if self.waited_s > 1.0:
            log.info("waited %.1f s on another process's build of %s", self.waited_s, self.path)
        # The holder's pid, for the log line of whoever waits on it next.
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        self._clear_torch_lock()

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _clear_torch_lock(self) -> None:
        # Under our lock no other prefixmesh process is building here: torch's marker is a dead
        # builder's, and torch would otherwise wait on it forever.
        stale = self.build_dir / "lock"
        if stale.exists():
            log.warning("removing a dead builder's lock: %s", stale)
            stale.unlink(missing_ok=True)

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode().strip() or "?"
    except OSError:
        return "?"
