"""`prefixmesh up` end to end: the README's first command, then `generate` and `top` against it.

Runs the CLI exactly as a user does (subprocesses), then SIGTERMs `up` and checks that it exits
cleanly and leaves no process behind. The tiny-model run uses `--api-key`.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from helpers import free_port

from prefixmesh.cli import up as up_cli
from prefixmesh.procs import LogSink, ProcessSpec, Supervisor, wait_serving
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "prefixmesh.cli"]


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc, so no psutil needed)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left


def _wait_listed(address: str, n: int, timeout_s: float, md=None) -> list[str]:  # noqa: ANN001
    deadline, ids = time.monotonic() + timeout_s, []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ClusterStub(channel)
        while time.monotonic() < deadline:
            state = stub.ListReplicas(pb.Empty(), timeout=5, metadata=md)
            ids = sorted(r.replica_id for r in state.replicas)
            if len(ids) >= n:
                break
            time.sleep(0.2)
    return ids


def _restart_replica_1(
    up: subprocess.Popen[bytes],
    log_path: Path,
    router: str,
    md=None,  # noqa: ANN001
) -> None:
    """SIGKILL replica-1: `up --restart` must report it and bring it back under the same id."""
    with grpc.insecure_channel(router) as channel:
        state = pb_grpc.ClusterStub(channel).ListReplicas(pb.Empty(), timeout=5, metadata=md)
        before = {r.replica_id: r.epoch for r in state.replicas}
    pid = int(re.search(r"started replica-1 \(pid (\d+)\)", log_path.read_text())[1])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and up.poll() is None:
        text = log_path.read_text(errors="replace")
        if f"replica-1 (pid {pid}) killed by SIGKILL" in text and "restarting replica-1" in text:
            with grpc.insecure_channel(router) as channel:
                stub = pb_grpc.ClusterStub(channel)
                state = stub.ListReplicas(pb.Empty(), timeout=5, metadata=md)
            epochs = {r.replica_id: r.epoch for r in state.replicas}
            if epochs.get("replica-1", before["replica-1"]) != before["replica-1"]:
                return
        time.sleep(0.3)
    raise AssertionError("replica-1 was not restarted:\n" + log_path.read_text()[-3000:])


def run_up_generate_top(
    model: str, tmp_path: Path, max_tokens: int, kill_and_restart: bool = False, api_key: str = ""
) -> None:
    port, http_port = free_port(), free_port()
    router = f"127.0.0.1:{port}"
    log_path = tmp_path / "up.log"
    children: set[int] = set()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXMESH_")}
    md = (("authorization", f"Bearer {api_key}"),) if api_key else None
    with log_path.open("wb") as log:
        up = subprocess.Popen(
            [*CLI, "up", "--replicas", "2", "--model", model, "--port", str(port),
             "--http-port", str(http_port), "--grace-period", "20", *(["--restart"] if kill_and_restart else []),
             *(["--api-key", api_key] if api_key else [])],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
    try:
        wait_serving(router, timeout_s=300, alive=lambda: up.poll() is None)
        assert _wait_listed(router, 2, timeout_s=30, md=md) == ["replica-0", "replica-1"]

        gen = subprocess.run(
            [*CLI, "generate", "--router", router, "--max-tokens", str(max_tokens),
             "--temperature", "0", "--ignore-eos", *(["--api-key", api_key] if api_key else []),
             "hello"],
            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.strip(), "no text streamed"
        assert "replica replica-" in gen.stderr, gen.stderr
        assert f"{max_tokens} tokens (length)" in gen.stderr, gen.stderr

        # The router's OpenAI-compatible HTTP door, as the banner's curl example uses it.
        body = json.dumps(
            {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            completion = json.loads(response.read())
        assert completion["usage"]["completion_tokens"] >= 1, completion

        top = subprocess.run(
            [*CLI, "top", "--router", router, "--once"],  # the key from the environment
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env=env | ({"PREFIXMESH_API_KEY": api_key} if api_key else {}),
        )  # fmt: skip
        assert top.returncode == 0, top.stderr
        rows = [ln for ln in top.stdout.splitlines() if "replica-" in ln and "kernels:" not in ln]
        assert len(rows) == 2 and all("%" in r for r in rows) and "kernels: " in top.stdout
        assert "refused" not in top.stdout  # the replicas took the key for GetStats too

        if kill_and_restart:
            _restart_replica_1(up, log_path, router, md)
        children = _descendants(up.pid)
        assert len(children) >= 4, children  # redis, 2 replicas, router
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        try:
            code = up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            code = up.wait()
    output = log_path.read_text(errors="replace")
    assert code == 0, output[-3000:]
    assert "had to SIGKILL" not in output, output[-3000:]
    assert "prefixmesh is up: router" in output
    assert "the router lists" not in output  # up's own wait saw every replica
    if api_key:
        assert api_key not in output  # not in a command line, the banner or a log line
        assert "API key required by the router and the replicas" in output
    gone_by = time.monotonic() + 10
    while any(_running(pid) for pid in children) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not [pid for pid in children if _running(pid)], output[-3000:]


@pytest.mark.cluster
def test_up_generate_top_shutdown(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_up_generate_top(
        str(tiny_model_dir), tmp_path, max_tokens=8, kill_and_restart=True, api_key="sk-up"
    )


@pytest.mark.slow
@pytest.mark.cluster
def test_up_smollm2_readme_command(tmp_path: Path) -> None:
    """The README's command on the real model (default --model smollm2)."""
    run_up_generate_top("smollm2", tmp_path, max_tokens=16)


def test_supervisor_prefixes_logs_and_kills_only_stubborn_children() -> None:
    out = io.StringIO()
    sup = Supervisor(LogSink(out=out), grace_s=1.0)
    wait = "import signal, time; {}; print('ready', flush=True); time.sleep(60)"
    polite = sup.start(ProcessSpec("polite", [sys.executable, "-c", wait.format("pass")]))
    stubborn = sup.start(
        ProcessSpec(
            "stubborn",
            [sys.executable, "-c", wait.format("signal.signal(signal.SIGTERM, signal.SIG_IGN)")],
        )
    )
    deadline = time.monotonic() + 30
    while out.getvalue().count("| ready") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "polite     | ready" in out.getvalue() and "stubborn   | ready" in out.getvalue()
    assert sup.shutdown() == ["stubborn"]
    assert not polite.alive() and polite.proc.returncode == -signal.SIGTERM
    assert not stubborn.alive() and stubborn.proc.returncode == -signal.SIGKILL


def test_api_key_reaches_router_and_replicas_by_environment_only(monkeypatch) -> None:
    monkeypatch.setenv("PREFIXMESH_API_KEY", "sk-from-env")
    assert up_cli.parse_config([]).api_key == "sk-from-env"
    assert up_cli.parse_config(["--api-key", ""]).api_key == ""  # a flag wins, even empty
    assert "sk-from-env" not in up_cli.build_parser().format_help()
    cfg = up_cli.parse_config(["--api-key", "sk-flag", "--redis", "redis://127.0.0.1:1/0"])
    assert cfg.api_key == "sk-flag" and "sk-flag" not in repr(cfg)
    plan = up_cli.make_plan(cfg)
    for spec in plan.replica_specs:
        assert spec.env == {"PREFIXMESH_API_KEY": "sk-flag"}
    # The router presents its own key to the replicas, whatever the shell's environment says.
    assert plan.router_spec.env == {
        "PREFIXMESH_API_KEY": "sk-flag", "PREFIXMESH_REPLICA_API_KEY": ""
    }  # fmt: skip
    for spec in [*plan.replica_specs, plan.router_spec]:
        assert "sk-flag" not in " ".join(spec.argv) and "sk-flag" not in repr(spec)
    text = up_cli.banner(cfg, plan)
    assert "sk-flag" not in text and 'Bearer $PREFIXMESH_API_KEY"' in text
    keyless = up_cli.make_plan(up_cli.parse_config(["--api-key", "", "--redis", "redis://x:1/0"]))
    assert keyless.replica_specs[0].env == {"PREFIXMESH_API_KEY": ""}  # beats the shell's key


def test_supervisor_sets_a_spec_env_on_top_of_its_own(monkeypatch) -> None:
    monkeypatch.setenv("PM_INHERITED", "yes")
    out = io.StringIO()
    sup = Supervisor(LogSink(out=out), grace_s=1.0)
    code = "import os; print(os.environ['PM_INHERITED'], os.environ['PM_GIVEN'], flush=True)"
    child = sup.start(ProcessSpec("env", [sys.executable, "-c", code], {"PM_GIVEN": "given"}))
    child.proc.wait(timeout=30)
    sup.shutdown()
    assert "env        | yes given" in out.getvalue()


def _exited_child(name: str, critical: bool = False):  # noqa: ANN202
    from prefixmesh.procs import Child

    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    return Child(spec=ProcessSpec(name, ["x"], critical=critical), proc=proc, started_at=0.0)


@pytest.mark.parametrize("restart", [True, False])
def test_up_keeps_serving_when_redis_or_a_replica_dies(restart: bool) -> None:
    """Defaults restart children; Redis (and a replica) dying never stops the cluster; only
    the router dying under --no-restart does."""
    cfg = up_cli.parse_config([] if restart else ["--no-restart"])
    assert cfg.restart is restart
    out = io.StringIO()
    sup = Supervisor(LogSink(out=out), grace_s=0)
    cluster = up_cli.Cluster(cfg, plan=None, sup=sup, stop=None)  # type: ignore[arg-type]
    for name in ("redis", "replica-0"):
        cluster._on_exit(_exited_child(name))
        assert not cluster.failed, out.getvalue()
        assert (name in cluster._due) is restart
    cluster._on_exit(_exited_child("router", critical=True))
    assert cluster.failed is not restart
    assert ("restarting router in 1s" in out.getvalue()) is restart
    if not restart:
        assert "keep serving without the shared prefix map" in out.getvalue()


def test_up_plan_redis_is_not_critical(monkeypatch) -> None:
    monkeypatch.setattr(up_cli, "find_redis_server", lambda: "redis-server")
    plan = up_cli.make_plan(up_cli.parse_config(["--replicas", "1"]))
    assert plan.redis_spec is not None and not plan.redis_spec.critical
    assert plan.router_spec.critical


def test_up_plan_never_hands_out_one_port_twice(monkeypatch) -> None:
    # A replica once failed to start: the port picked for it was the one picked for Redis a
    # moment before (closed in between, so the OS handed it out again). This socket does that
    # every time: port 0 binds the lowest port nobody holds.
    from prefixmesh import ports as ports_module

    held: set[int] = set()

    class ReusingSocket:
        def __init__(self, *args) -> None:
            self.port = None

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            held.discard(self.port)

        def bind(self, address) -> None:
            self.port = min(set(range(40000, 40100)) - held)
            held.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(ports_module.socket, "socket", ReusingSocket)
    monkeypatch.setattr(up_cli, "find_redis_server", lambda: "redis-server")
    plan = up_cli.make_plan(up_cli.parse_config(["--replicas", "3", "--metrics"]))
    redis_port = int(plan.redis_url.rsplit(":", 1)[1].split("/")[0])
    replica_ports = [int(a.rsplit(":", 1)[1]) for a in plan.replica_addresses]
    ports = [redis_port, *replica_ports, *plan.metrics.values()]
    assert len(ports) == 1 + 3 + 4 and len(set(ports)) == len(ports), ports
    assert not held  # every picking socket closed


def test_tls_files_reach_router_and_replicas_by_environment(tmp_path: Path) -> None:
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    for path in files.values():
        path.write_text("pem")
    base = ["--redis", "redis://127.0.0.1:1/0"]
    cfg = up_cli.parse_config([*base, "--tls-cert", str(files["cert"]), "--tls-key",
                               str(files["key"]), "--tls-ca", str(files["ca"]),
                               "--tls-client-ca", str(files["ca"])])  # fmt: skip
    plan = up_cli.make_plan(cfg)
    served = {"PREFIXMESH_TLS_CERT": str(files["cert"]), "PREFIXMESH_TLS_KEY": str(files["key"]),
              "PREFIXMESH_TLS_CA": str(files["ca"])}  # fmt: skip
    for spec in plan.replica_specs:
        assert spec.env.items() >= (served | {"PREFIXMESH_TLS_CLIENT_CA": str(files["ca"])}).items()
    # The router serves clients without asking for their certificates.
    assert plan.router_spec.env.items() >= served.items()
    assert "PREFIXMESH_TLS_CLIENT_CA" not in plan.router_spec.env
    assert cfg.tls_files().ca == str(files["ca"]) and cfg.tls_files().cert == str(files["cert"])
    text = up_cli.banner(cfg, plan)
    assert f"--tls-ca {files['ca']}" in text and "https://" in text and "-plaintext" not in text
    for argv, message in (
        (["--tls-cert", str(files["cert"])], "go together"),
        (["--tls-cert", str(files["cert"]), "--tls-key", str(files["key"])], "needs --tls-ca"),
        (["--tls-ca", str(files["ca"])], "needs --tls-cert"),
        (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(files["key"]),
          "--tls-ca", str(files["ca"])], "no such file"),
    ):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            up_cli.parse_config([*base, *argv])
    assert up_cli.make_plan(up_cli.parse_config(base)).replica_specs[0].env == {
        "PREFIXMESH_API_KEY": ""
    }  # no TLS: nothing added
