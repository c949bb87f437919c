"""deploy/docker-compose.yml as a user runs it, on a real Docker engine (issue 48).

The module's fixture starts a private dockerd (tests/docker_engine.py), builds both images from
a local stand-in base (no registry is reachable here) with the local torch wheel, and stops
and cleans everything at the end, checking that iptables and links are as they were. Then, in
order: 3 replicas up, each on its prebuilt kernels; generation through 127.0.0.1:50050 with a
shared-prefix group that sticks; scaling 3 -> 1 -> 2; a replica's process killed mid-stream
with no request lost; and ``down -v`` leaving nothing. The replica image's build (four kernel
compiles, vfs copies) took over 30 minutes on a loaded 2-core host (docs/deploy.md).
Opt-in: it runs only with PREFIXMESH_DOCKER_TEST=1, and then needs root, dockerd,
docker-compose and debootstrap (.ci/run installs them; their absence fails, not skips).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from docker_engine import BASE_TAG, Dockerd, check_disk, import_base_images, run, serve_wheels

from kernels import cpu_flags
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
ROUTER = "127.0.0.1:50050"
PROJECT = "pmtest"
SERVICES = ["redis", "model", "replica", "router"]  # no Prometheus/Grafana: no images here
TOOLS = ("dockerd", "docker", "docker-compose", "debootstrap", "iptables-save")
# The first test's limit covers the fixture's image builds: 30+ minutes on a loaded 2-core host.
pytestmark = pytest.mark.timeout(5400)


class Cluster:
    """The compose project of this module's tests, on the private engine."""

    def __init__(self, dockerd: Dockerd) -> None:
        self.dockerd = dockerd
        self.timings: dict[str, float] = {}

    def compose(self, *args: str, timeout: float = 600) -> str:
        cmd = ["docker-compose", "-p", PROJECT, "-f", str(ROOT / "deploy/docker-compose.yml")]
        return run([*cmd, *args], env=self.dockerd.env, timeout=timeout)

    def docker(self, *args: str, timeout: float = 120) -> str:
        return run(["docker", *args], env=self.dockerd.env, timeout=timeout)

    def replicas(self) -> list[str]:
        """The replica containers' ids, as compose lists them."""
        return self.compose("ps", "-q", "replica").split()

    def inspect(self, container: str) -> dict:
        return json.loads(self.docker("inspect", container))[0]


def _missing_tools() -> str:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root")
    return ", ".join(missing)


def _build_images(cluster: Cluster, index_url: str) -> None:
    env = cluster.dockerd.env
    for name, args in (
        ("router", []),
        ("replica", ["--build-arg", f"TORCH_INDEX_URL={index_url}",
                     "--build-arg", "PRELOAD_MODEL=smollm2"]),
    ):  # fmt: skip
        start = time.monotonic()
        run(["docker", "build", "--network", "host", "--build-arg", f"BASE_IMAGE={BASE_TAG}",
             *args, "-f", f"deploy/Dockerfile.{name}", "-t", f"prefixmesh-{name}", "."],
            env=env, timeout=3600, cwd=ROOT)  # fmt: skip
        cluster.timings[f"build {name} s"] = time.monotonic() - start
        size = int(cluster.docker("image", "inspect", "-f", "{{.Size}}", f"prefixmesh-{name}"))
        cluster.timings[f"{name} image MB"] = size / 1e6


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if os.environ.get("PREFIXMESH_DOCKER_TEST") != "1":
        # Opt-in until the image build fits CI's budget: on a 2-core host it took over 30
        # minutes (docs/deploy.md), which alone would push .ci/run past 45 minutes.
        pytest.skip("the docker test runs only with PREFIXMESH_DOCKER_TEST=1 (30+ minutes)")
    missing = _missing_tools()
    if missing:
        pytest.fail(f"the docker test needs {missing} (.ci/run installs the Debian packages)")
    with socket.socket() as probe:  # the compose file publishes the router here
        if probe.connect_ex(("127.0.0.1", 50050)) == 0:
            pytest.fail("127.0.0.1:50050 is taken: stop what listens there (a local router?)")
    root = Path(tempfile.mkdtemp(prefix="pm-docker-"))
    check_disk(root)
    dockerd = Dockerd(root)
    cluster = Cluster(dockerd)
    server = None
    try:
        dockerd.start()
        import_base_images(dockerd)
        index_url, server = serve_wheels(
            root / "wheels", sorted(Path("/opt/wheels").glob("torch-*.whl"))
        )
        _build_images(cluster, index_url)
        yield cluster
    finally:
        subprocess.run(
            ["docker-compose", "-p", PROJECT, "-f", str(ROOT / "deploy/docker-compose.yml"),
             "down", "-v", "--remove-orphans"], env=dockerd.env, capture_output=True, timeout=300,
        )  # fmt: skip
        if server is not None:
            server.shutdown()
        before = dockerd.iptables_before
        dockerd.stop()
        print(f"\ndocker test timings: {json.dumps(cluster.timings, indent=1)}")
        assert not root.exists(), f"data root {root} left behind"
        assert _rules(run(["iptables-save"])) == _rules(before), "iptables not restored"


def _rules(dump: str) -> list[str]:
    """An iptables-save dump's rules, chains and policies, without counters; a built-in chain
    that accepts is the same as a table not there."""
    lines = [ln.rsplit(" [", 1)[0] for ln in dump.splitlines() if ln.startswith(("-", ":"))]
    return [ln for ln in lines if not (ln.endswith(" ACCEPT") and ln[1:].split()[0].isupper())]


def _stub() -> tuple[grpc.Channel, pb_grpc.ClusterStub, pb_grpc.GeneratorStub]:
    channel = grpc.insecure_channel(ROUTER)
    return channel, pb_grpc.ClusterStub(channel), pb_grpc.GeneratorStub(channel)


def _wait_listed(count: int, timeout: float) -> list[pb.ReplicaInfo]:
    channel, cluster_stub, _ = _stub()
    deadline, listed = time.monotonic() + timeout, []
    with channel:
        while time.monotonic() < deadline:
            try:
                listed = list(cluster_stub.ListReplicas(pb.Empty(), timeout=5).replicas)
            except grpc.RpcError:
                listed = []
            if len(listed) == count:
                return listed
            time.sleep(0.5)
    raise AssertionError(f"router lists {[r.replica_id for r in listed]}, want {count}")


def _wait_healthy(cluster: Cluster, count: int, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = cluster.replicas()
        states = [cluster.inspect(c)["State"].get("Health", {}).get("Status") for c in ids]
        if len(ids) == count and all(s == "healthy" for s in states):
            return ids
        time.sleep(1)
    logs = "".join(cluster.docker("logs", "--tail", "30", c) for c in cluster.replicas())
    raise AssertionError(f"replicas not healthy after {timeout} s: {states}\n{logs[-4000:]}")


def _generate(text: str, max_tokens: int = 8) -> list[pb.GenerateResponse]:
    channel, _, gen = _stub()
    request = pb.GenerateRequest(
        text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    with channel:
        return list(gen.Generate(request, timeout=300))


MODEL_INFO = (
    "import grpc; from proto import prefixmesh_pb2 as pb, prefixmesh_pb2_grpc as g; "
    "i = g.ReplicaStub(grpc.insecure_channel('127.0.0.1:50051')).GetModelInfo(pb.Empty(), "
    "timeout=10); print(i.kernel_build + '|' + i.dtype)"
)


def test_three_replicas_serve_on_prebuilt_kernels(cluster: Cluster) -> None:
    start = time.monotonic()
    cluster.compose("up", "-d", "--scale", "replica=3", *SERVICES)
    ids = _wait_healthy(cluster, 3, timeout=300)
    cluster.timings["up to 3 healthy s"] = time.monotonic() - start
    listed = _wait_listed(3, timeout=60)
    assert {r.address.split(":")[0] for r in listed} == {c[:12] for c in ids}
    isa = cpu_flags.cpu_isa()
    for container in ids:
        build, dtype = (
            cluster.docker("exec", container, "python", "-c", MODEL_INFO).strip().split("|")
        )
        assert build == f"cpu_ops {isa} (prebuilt)", build
        assert dtype in ("float32", "bfloat16")
        logs = run(["docker", "logs", container], env=cluster.dockerd.env, stderr=subprocess.STDOUT)
        assert "UNAVAILABLE" not in logs and "building CPU kernels" not in logs, logs[-2000:]


def test_generate_through_the_router_and_a_shared_prefix_sticks(cluster: Cluster) -> None:
    out = _generate("hello from a container")
    assert sum(len(m.token_ids) for m in out) == 8 and out[-1].finish_reason == "length"
    prefix = "You are a careful assistant who answers in one short sentence. " * 6
    group = [_generate(prefix + f"Question {i}: what is {i} + {i}?") for i in range(4)]
    served = {g[-1].replica_id for g in group}
    assert len(served) == 1, served  # cache-aware routing keeps the group on one replica
    assert all(g[-1].usage.cached_tokens >= 64 for g in group[1:]), [g[-1].usage for g in group]


def test_scale_three_one_two_followed_by_the_router(cluster: Cluster) -> None:
    for count in (1, 2):
        cluster.compose("up", "-d", "--no-recreate", "--scale", f"replica={count}", *SERVICES)
        _wait_healthy(cluster, count, timeout=300)
        listed = _wait_listed(count, timeout=60)
        assert {r.address.split(":")[0] for r in listed} == {c[:12] for c in cluster.replicas()}
        assert sum(len(m.token_ids) for m in _generate(f"now {count} replicas")) == 8


def test_kill_a_replica_mid_stream_loses_no_request(cluster: Cluster) -> None:
    results: list[list[pb.GenerateResponse] | Exception] = []
    first = threading.Event()
    serving: list[str] = []  # replica ids of the streams' first messages

    def stream(i: int) -> None:
        channel, _, gen = _stub()
        sampling = pb.SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        try:
            with channel:
                got = []
                request = pb.GenerateRequest(text=f"stream {i}", sampling=sampling)
                for msg in gen.Generate(request, timeout=300):
                    if not got:
                        serving.append(msg.replica_id)
                        first.set()
                    got.append(msg)
                results.append(got)
        except Exception as exc:  # kept: the assertion below shows it
            results.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert first.wait(120), "no stream started"
    hosts = {r.replica_id: r.address.split(":")[0] for r in _wait_listed(2, timeout=10)}
    victim = next(c for c in cluster.replicas() if c.startswith(hosts[serving[0]]))
    restarts = cluster.inspect(victim)["RestartCount"]
    os.kill(cluster.inspect(victim)["State"]["Pid"], signal.SIGKILL)  # the replica process
    for t in threads:
        t.join(300)
    for got in results:
        assert not isinstance(got, Exception), got
        assert sum(len(m.token_ids) for m in got) == 120 and got[-1].finish_reason == "length"
    assert len(results) == 2
    deadline = time.monotonic() + 120
    while cluster.inspect(victim)["RestartCount"] == restarts and time.monotonic() < deadline:
        time.sleep(1)
    assert cluster.inspect(victim)["RestartCount"] > restarts, "the container was not restarted"
    _wait_healthy(cluster, 2, timeout=300)
    _wait_listed(2, timeout=60)


def test_down_removes_everything(cluster: Cluster) -> None:
    cluster.compose("down", "-v")
    assert cluster.docker("ps", "-aq").split() == []
    assert cluster.docker("volume", "ls", "-q").split() == []
    networks = cluster.docker("network", "ls", "--format", "{{.Name}}").split()
    assert sorted(networks) == ["bridge", "host", "none"], networks
