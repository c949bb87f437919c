"""A private Docker engine for tests/test_docker.py, and what it needs on a machine with no
image registry (docs/deploy.md, "Testing with a real engine").

:class:`Dockerd` runs its own ``dockerd`` (vfs storage, its own data root, exec root and socket
under a temporary folder, no masquerading) and undoes everything it did when stopped: iptables
restored to the saved state, the bridges it made deleted, the data root removed. Containers
cannot leave the machine: a DROP rule in DOCKER-USER stops their traffic to the outside
interface. Builds run on the host network, where the package indexes are.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import signal
import subprocess
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Peak disk of the two vfs builds (issue 48: ~19 GB), with a margin.
NEED_DISK_GB = 25
BASE_TAG = "prefixmesh-test-base"
REDIS_TAG = "redis:7-alpine"  # the name deploy/docker-compose.yml asks for
# A debootstrap root, kept between runs: making one takes minutes.
ROOTFS_CACHE = Path(os.environ.get("PREFIXMESH_DOCKER_ROOTFS", "/tmp/prefixmesh-docker-rootfs"))
CA_DIR = Path("/usr/local/share/ca-certificates")


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600, **kw) -> str:
    """``cmd``'s stdout; a failure raises with the command's last output lines."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
        raise RuntimeError(f"`{' '.join(cmd)}` exited {done.returncode}:\n{tail}")
    return done.stdout


def _links() -> set[str]:
    return {
        line.split(":")[1].strip().split("@")[0] for line in run(["ip", "-o", "link"]).splitlines()
    }


def _outside_interface() -> str:
    route = run(["ip", "route", "show", "default"]).split()
    return route[route.index("dev") + 1]


@dataclass
class Dockerd:
    """A dockerd of its own under ``root``; :meth:`stop` leaves the machine as it was."""

    root: Path
    proc: subprocess.Popen | None = None
    iptables_before: str | None = None
    links_before: set[str] = field(default_factory=set)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.root}/sock"}

    def start(self) -> None:
        self.iptables_before = run(["iptables-save"])
        self.links_before = _links()
        log = open(self.root / "dockerd.log", "w")
        self.proc = subprocess.Popen(
            ["dockerd", "--data-root", f"{self.root}/data", "--exec-root", f"{self.root}/exec",
             "--pidfile", f"{self.root}/pid", "--host", f"unix://{self.root}/sock",
             "--storage-driver", "vfs", "--ip-masq=false"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], env=self.env, capture_output=True).returncode:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"dockerd did not start:\n{self.log()[-3000:]}")
            time.sleep(0.5)
        run(["iptables", "-I", "DOCKER-USER", "-o", _outside_interface(), "-j", "DROP"])

    def log(self) -> str:
        return (self.root / "dockerd.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for link in sorted(_links() - self.links_before):
            subprocess.run(["ip", "link", "delete", link], capture_output=True)
        if self.iptables_before is not None:
            restore_iptables(self.iptables_before)
        for mount in reversed(Path("/proc/mounts").read_text().splitlines()):
            point = mount.split()[1]
            if point.startswith(str(self.root)):
                subprocess.run(["umount", "-l", point], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


# Each table's built-in chains, for a table the saved state did not have (an empty dump).
BUILTIN_CHAINS = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
}


def restore_iptables(before: str) -> None:
    """Every table as ``before`` (an iptables-save dump) had it. iptables-restore replaces only
    the tables its input names, so a table dockerd made from nothing is named, empty."""
    saved = {block.split("\n", 1)[0]: block for block in before.split("*")[1:]}
    now = {block.split("\n", 1)[0] for block in run(["iptables-save"]).split("*")[1:]}
    dump = "".join(f"*{saved[t]}" for t in saved)
    for table in sorted(now - set(saved)):
        chains = "".join(f":{c} ACCEPT [0:0]\n" for c in BUILTIN_CHAINS.get(table, ()))
        dump += f"*{table}\n{chains}COMMIT\n"
    if dump:
        run(["iptables-restore"], input=dump)


def check_disk(folder: Path) -> None:
    free_gb = shutil.disk_usage(folder).free / 1e9
    if free_gb < NEED_DISK_GB:
        raise RuntimeError(
            f"the docker test needs {NEED_DISK_GB} GB free under {folder} for vfs image builds, "
            f"and {free_gb:.1f} GB is free: free disk or point TMPDIR elsewhere"
        )


def _chroot(rootfs: Path, script: str) -> None:
    run(["chroot", str(rootfs), "/bin/sh", "-ec", script], timeout=900)


def stand_in_rootfs() -> Path:
    """A Debian root with python 3, venv and pip (and redis-server), made once with debootstrap;
    the host's interception CA, if any, is trusted inside, so pip reaches PyPI."""
    done = ROOTFS_CACHE / ".prefixmesh-ready"
    rootfs = ROOTFS_CACHE / "rootfs"
    if done.exists():
        return rootfs
    if not (rootfs / "usr/bin/apt-get").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        rootfs.parent.mkdir(parents=True, exist_ok=True)
        run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs)], timeout=1200)
    (rootfs / "usr/local/share/ca-certificates").mkdir(parents=True, exist_ok=True)
    for crt in CA_DIR.glob("*.crt"):
        shutil.copy(crt, rootfs / "usr/local/share/ca-certificates" / crt.name)
    shutil.copy("/etc/resolv.conf", rootfs / "etc/resolv.conf")
    _chroot(
        rootfs,
        "export DEBIAN_FRONTEND=noninteractive; apt-get update -qq; "
        "apt-get install -y -qq --no-install-recommends python3 python3-venv python3-pip "
        "ca-certificates > /dev/null; update-ca-certificates > /dev/null; "
        "python3 -m venv /opt/venv; apt-get clean; rm -rf /var/lib/apt/lists/*",
    )
    done.touch()
    return rootfs


def import_base_images(dockerd: Dockerd) -> None:
    """``prefixmesh-test-base`` (python on PATH from /opt/venv) and the redis stand-in."""
    rootfs = stand_in_rootfs()
    tar = dockerd.root / "rootfs.tar"
    with tarfile.open(tar, "w") as out:
        out.add(rootfs, arcname=".")
    env = "ENV PATH=/opt/venv/bin:/usr/local/bin:/usr/bin:/bin"
    run(["docker", "import", "--change", env, str(tar), BASE_TAG], env=dockerd.env)
    context = dockerd.root / "redis"  # not the root: dockerd's own files are there
    context.mkdir()
    redis = context / "Dockerfile"
    # Like the real image's entrypoint: protected mode off, since its clients are other
    # containers; compose's `command:` becomes the entrypoint's arguments.
    (context / "redis-entry").write_text('#!/bin/sh\nexec "$@" --protected-mode no\n')
    (context / "redis-entry").chmod(0o755)
    redis.write_text(
        f"FROM {BASE_TAG}\nCOPY redis-entry /usr/local/bin/\n"
        "RUN apt-get update -qq && apt-get install -y -qq redis-server > /dev/null "
        "&& rm -rf /var/lib/apt/lists/*\n"
        'ENTRYPOINT ["/usr/local/bin/redis-entry"]\nCMD ["redis-server"]\n'
    )
    run(["docker", "build", "--network", "host", "-t", REDIS_TAG, "-f", str(redis), str(context)],
        env=dockerd.env)  # fmt: skip
    tar.unlink()


def serve_wheels(folder: Path, wheels: list[Path]) -> tuple[str, http.server.HTTPServer]:
    """A loopback package index (``<url>/torch/``) offering ``wheels``: TORCH_INDEX_URL."""
    (folder / "torch").mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        shutil.copy(wheel, folder / "torch" / wheel.name)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/", server
