"""deploy/ cannot drift from the code: the compose file's commands run as local processes and
serve a request, its env vars are real flags, the router image has no torch, the dashboard
queries metrics that exist, and the Kubernetes manifests probe the right ports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import tomllib
import yaml
from helpers import Proc, free_port, stop_all
from packaging.requirements import Requirement

from prefixmesh.redis_server import find_redis_server, wait_for_redis
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
# Services that are images of other projects, with no local process to run.
MONITORING = {"prometheus", "grafana"}
# Environment variables that are not flags: the loader's cache folder.
NOT_FLAGS = {"PREFIXMESH_CACHE"}
# `${NAME}` / `${NAME:-default}`: compose fills these in from the shell (or deploy/.env).
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
TORCH_LIKE = {"torch", "triton", "transformers", "accelerate", "nvidia-cudnn-cu12"}


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _k8s_docs() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


# -- the router image has no torch ----------------------------------------------------------


def _closure(requirements: list[str]) -> set[str]:
    """Distribution names these requirements pull in, transitively (installed metadata)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(name) or []]
        except metadata.PackageNotFoundError:
            pass  # not installed here (e.g. uvloop on another platform): no further edges
    return seen


def test_router_image_installs_only_base_dependencies_without_torch() -> None:
    dockerfile = (DEPLOY / "Dockerfile.router").read_text()
    installs = [ln for ln in dockerfile.splitlines() if re.match(r"RUN\s+pip install", ln)]
    assert installs == ["RUN pip install /src && rm -rf /src"], installs  # no [extra]
    assert "torch" not in dockerfile.replace("# ", "").split("FROM", 1)[1].lower()
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    closure = _closure(base)
    assert "grpcio" in closure and "redis" in closure  # the walk really ran
    assert not closure & TORCH_LIKE, closure & TORCH_LIKE


def test_replica_image_installs_cpu_torch_pinned() -> None:
    dockerfile = (DEPLOY / "Dockerfile.replica").read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    assert re.search(
        r'--extra-index-url "\$\{TORCH_INDEX_URL\}" \\\s+-c /src/constraints.txt', dockerfile
    )
    assert '"/src[${EXTRAS}]"' in dockerfile and "ARG EXTRAS=replica" in dockerfile


# -- compose: structure, flags, and a local run of its commands ------------------------------


def _flag_dests(command: str) -> set[str]:
    if command == "router":
        from router.config import build_parser
    else:
        from replica.server.config import build_parser
    return {a.dest for a in build_parser()._actions}


def _check_env_are_flags(command: str, env: dict[str, str]) -> None:
    dests = _flag_dests(command)
    unknown = [
        k for k in env if k not in NOT_FLAGS and k.removeprefix("PREFIXMESH_").lower() not in dests
    ]
    assert not unknown, f"not flags of `prefixmesh {command}`: {unknown}"


def test_compose_scales_and_uses_real_flags() -> None:
    services = _compose()["services"]
    replica = services["replica"]
    # `--scale replica=N` must work unedited: no fixed name, no host port, self-advertised.
    assert "container_name" not in replica and "ports" not in replica
    assert replica["environment"]["PREFIXMESH_ADVERTISE_HOST"] == "auto"
    assert "model-cache:/cache" in replica["volumes"]
    for name in ("replica", "router"):
        assert services[name]["command"] == ["prefixmesh", name]
        _check_env_are_flags(name, services[name]["environment"])
        # One PREFIXMESH_API_KEY in the shell keys the router and every replica.
        assert services[name]["environment"]["PREFIXMESH_API_KEY"] == "${PREFIXMESH_API_KEY:-}"
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    sd = jobs["replica"]["dns_sd_configs"][0]
    assert sd["names"] == ["replica"] and sd["type"] == "A"
    assert sd["port"] == int(replica["environment"]["PREFIXMESH_METRICS_PORT"])
    router_sd = jobs["router"]["dns_sd_configs"][0]
    assert router_sd["port"] == int(services["router"]["environment"]["PREFIXMESH_METRICS_PORT"])


def _compose_client() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_validates() -> None:
    client = _compose_client()
    if client is None:
        pytest.skip("no docker compose client installed (apt-get install docker-compose)")
    done = subprocess.run(
        [*client, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


class LocalCompose:
    """Runs compose services as local processes. The whole substitution is here:
    hostnames -> 127.0.0.1, every *_PORT and Redis' port -> a free port, the model -> the tiny
    model folder, the model cache -> a temp folder, `prefixmesh`/`python`/`redis-server` ->
    this interpreter / the bundled Redis, `${NAME:-default}` -> ``shell[NAME]`` or default."""

    def __init__(
        self, services: dict, model: Path, cache: Path, shell: dict[str, str] | None = None
    ) -> None:
        self.services, self.model, self.cache = services, model, cache
        self.shell = shell or {}
        self.redis_port = free_port()
        self.router_port = 0
        self.procs: list[Proc] = []

    def _argv(self, command: list[str]) -> list[str]:
        head = {
            "prefixmesh": [sys.executable, "-m", "prefixmesh.cli"],
            "python": [sys.executable],
            "redis-server": [find_redis_server()],
        }[command[0]]
        argv = head + command[1:]
        if command[0] == "redis-server":
            argv += ["--port", str(self.redis_port), "--bind", "127.0.0.1"]
        return argv

    def _env(self, service: dict) -> tuple[dict[str, str], int]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXMESH_")}
        env["PYTHONPATH"] = str(ROOT)
        port = 0
        for key, value in (service.get("environment") or {}).items():
            value = INTERPOLATION.sub(
                lambda m: self.shell.get(m[1]) or m[2] or "", str(value)
            ).replace("redis:6379", f"127.0.0.1:{self.redis_port}")
            if key.endswith("_PORT"):
                value = str(free_port())
                port = int(value) if key == "PREFIXMESH_PORT" else port
            elif key in ("PREFIXMESH_HOST", "PREFIXMESH_ADVERTISE_HOST"):
                value = "127.0.0.1"
            elif key == "PREFIXMESH_MODEL":
                value = str(self.model)
            elif key == "PREFIXMESH_CACHE":
                value = str(self.cache)
            env[key] = value
        return env, port

    def start(self, name: str) -> tuple[Proc, int]:
        """One service as a process with exactly the compose environment (nothing inherited)."""
        env, port = self._env(self.services[name])
        argv = self._argv(self.services[name]["command"])
        proc = Proc(f"{name}-{len(self.procs)}", argv, env, grace_s=30.0, inherit_env=False)
        self.procs.append(proc)
        return proc, port

    def logs(self) -> str:
        return "\n".join(p.logs() for p in self.procs)

    def stop(self) -> None:
        stop_all(self.procs)


@pytest.mark.cluster
def test_compose_services_serve_a_request_as_local_processes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    services = _compose()["services"]
    assert set(services) - MONITORING == {"redis", "model", "replica", "router"}
    key = "sk-compose"  # as `PREFIXMESH_API_KEY=sk-compose docker compose up` would set it
    md = (("authorization", f"Bearer {key}"),)
    local = LocalCompose(services, tiny_model_dir, tmp_path / "cache", {"PREFIXMESH_API_KEY": key})
    try:
        redis_proc, _ = local.start("redis")
        wait_for_redis("127.0.0.1", local.redis_port, alive=redis_proc.alive)
        model, _ = local.start("model")
        assert model.proc.wait(timeout=300) == 0, model.logs()
        replicas = [local.start("replica") for _ in range(2)]
        for proc, port in replicas:
            proc.wait_serving(f"127.0.0.1:{port}", 300)
            with (
                grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
                pytest.raises(grpc.RpcError) as denied,
            ):
                pb_grpc.ReplicaStub(channel).GetStats(pb.Empty(), timeout=5)  # keyed: no key
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        router, router_port = local.start("router")
        address = f"127.0.0.1:{router_port}"
        router.wait_serving(address, 120)
        with grpc.insecure_channel(address) as channel:
            deadline, listed = time.monotonic() + 30, []
            while len(listed) < 2 and time.monotonic() < deadline:
                state = pb_grpc.ClusterStub(channel).ListReplicas(
                    pb.Empty(), timeout=5, metadata=md
                )
                listed = [r.replica_id for r in state.replicas]
                time.sleep(0.2)
            assert len(listed) == 2, local.logs()[-3000:]
            request = pb.GenerateRequest(
                text="hello from compose",
                sampling=pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
            )
            # The router sends the same key on to the (keyed) replica.
            out = list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=120, metadata=md))
        assert sum(len(m.token_ids) for m in out) == 6
        assert out[-1].finish_reason == "length" and out[-1].replica_id in listed
    finally:
        local.stop()


# -- Grafana and Kubernetes -------------------------------------------------------------------


def _exported_series() -> set[str]:
    """Every series name the replica and router /metrics endpoints can expose."""
    from replica.preemption_stats import PreemptionCounts
    from replica.server.metrics import ReplicaMetrics
    from router.metrics import RouterMetrics

    stats = SimpleNamespace(
        running=0, waiting=0, kv_usage=0.0, num_blocks=1, free_blocks=1, cached_blocks=0,
        queued_tokens=0, prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0,
        prompt_tokens=0, generation_tokens=0, finished_by_reason={"stop": 1}, kept_hashes=0,
        kept_evictions=0, preempt=PreemptionCounts(),
    )  # fmt: skip
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names = set()
    for registry in (ReplicaMetrics(lambda: stats, "m", "r").registry, RouterMetrics().registry):
        for family in registry.collect():
            names |= {family.name + s for s in suffixes.get(family.type, [""])}
    return names


def test_grafana_dashboard_queries_exported_metrics() -> None:
    import json

    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "prefixmesh.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(?:prefixmesh|router)_[a-z0-9_]+", e)}
    assert used, exprs
    assert not used - _exported_series(), used - _exported_series()
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    assert "hit rate" in titles and "running" in titles and "time to first token" in titles


def test_k8s_manifests_probe_grpc_health_and_select_their_pods() -> None:
    docs = _k8s_docs()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert set(deployments) == {"redis", "router", "replica"}
    assert set(services) == {"redis", "router"}  # replicas are found through Redis leases
    for name, svc in services.items():
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
    for name in ("router", "replica"):
        container = deployments[name]["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["prefixmesh", name]
        env = {e["name"]: e.get("value", "") for e in container["env"]}
        _check_env_are_flags(name, env)
        port = int(env["PREFIXMESH_PORT"])
        assert container["readinessProbe"]["grpc"]["port"] == port
        assert port in [p["containerPort"] for p in container["ports"]]
    replica_spec = deployments["replica"]["spec"]["template"]["spec"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in replica_spec["volumes"]]
    assert claims == ["model-cache"]
    if shutil.which("kubectl"):  # renders offline; catches what plain YAML parsing cannot
        done = subprocess.run(
            ["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("\nkind: Deployment") == 3
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml"
    )


# The Kubernetes release the manifests are checked against (kubernetes-validate's schemas, offline).
K8S_VERSION = "1.30.0"


def test_k8s_manifests_validate_against_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    checked = []
    for folder in ("k8s",):  # k8s-tls holds strategic-merge patches, not whole objects
        for path in sorted((DEPLOY / folder).glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if not doc or doc.get("kind") == "Kustomization":  # a kustomize file, no API
                    continue
                # strict: a misspelt or misplaced field fails, not only a missing one
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                checked.append(f"{path.name}:{doc['kind']}")
    assert len(checked) >= 6, checked
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        bad = next(d for d in _k8s_docs() if d["kind"] == "Deployment")
        bad["spec"]["replicas"] = "three"
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
