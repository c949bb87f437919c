"""TLS end to end: client -> router over TLS, router -> replica over mutual TLS, HTTPS on both
front doors, and plaintext or certificate-less clients refused.

A throwaway CA and three leaf certificates (replica, router, client), each naming 127.0.0.1,
are generated in the test with ``cryptography``.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from mini_cluster import ROOT, MiniCluster, start_mini_cluster

from prefixmesh.tls import TlsFiles
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.cluster

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))  # fmt: skip


def make_pki(folder: Path) -> dict[str, Path]:
    """ca.pem plus <role>.pem / <role>.key for replica, router and client."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("prefixmesh test CA"))
        .issuer_name(_name("prefixmesh test CA")).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = {"ca": folder / "ca.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role in ("replica", "router", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder().subject_name(_name(f"prefixmesh {role}"))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            ]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([
                ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH,
            ]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )  # fmt: skip
        paths[role] = folder / f"{role}.pem"
        paths[f"{role}_key"] = folder / f"{role}.key"
        paths[role].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, paths[f"{role}_key"])
    return paths


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, pki: dict[str, Path]) -> Iterator[MiniCluster]:
    """Replica: TLS, requires client certificates from the CA (mTLS). Router: TLS to clients
    (no client certificate needed), mTLS to the replica with its own certificate."""
    client = TlsFiles(str(pki["client"]), str(pki["client_key"]), "", str(pki["ca"]))
    c = start_mini_cluster(
        str(tiny_model_dir),
        replica_args=("--tls-cert", str(pki["replica"]), "--tls-key", str(pki["replica_key"]),
                      "--tls-client-ca", str(pki["ca"]), "--tls-ca", str(pki["ca"])),
        # From the environment, as compose and k8s hand them over.
        router_env={"PREFIXMESH_TLS_CERT": str(pki["router"]),
                    "PREFIXMESH_TLS_KEY": str(pki["router_key"]),
                    "PREFIXMESH_TLS_CA": str(pki["ca"])},
        client_tls=client, namespace="tls",
    )  # fmt: skip
    yield c
    c.stop()


def _generate(channel: grpc.Channel) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        text="hello over tls",
        sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
    )
    return list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=30))


def test_client_router_replica_over_mtls(cluster: MiniCluster, pki: dict[str, Path]):
    ca_only = TlsFiles(ca=str(pki["ca"]))
    with cluster.channel(cluster.router_grpc, ca_only) as ch:  # no client cert needed here
        msgs = _generate(ch)
    assert msgs[-1].finish_reason == "length" and msgs[-1].replica_id == "tls-0"
    assert msgs[-1].usage.completion_tokens == 4
    with cluster.channel(cluster.replica_grpc) as ch:  # with the client certificate
        assert _generate(ch)[-1].finish_reason == "length"


def test_plaintext_and_certless_clients_are_refused(cluster: MiniCluster, pki: dict[str, Path]):
    for address in (cluster.router_grpc, cluster.replica_grpc):
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
            _generate(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, address
    # The replica wants a client certificate signed by the CA: trusting it is not enough.
    with cluster.channel(cluster.replica_grpc, TlsFiles(ca=str(pki["ca"]))) as ch:
        with pytest.raises(grpc.RpcError) as err:
            _generate(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Plain HTTP to the HTTPS front door gets no answer.
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{cluster.router_http}/health", timeout=5).read()


def _https(url: str, context: ssl.SSLContext, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60, context=context) as resp:
        return json.loads(resp.read())


def test_https_front_doors(cluster: MiniCluster, pki: dict[str, Path]):
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    reply = _https(f"https://{cluster.router_http}/v1/completions", context, body)
    assert reply["usage"]["completion_tokens"] == 3
    # The replica's door requires a client certificate too (mTLS) ...
    with pytest.raises((ssl.SSLError, OSError)):
        _https(f"https://{cluster.replica_http}/v1/completions", context, body)
    # ... and with one it answers (its door reaches its own gRPC port over mTLS).
    context.load_cert_chain(str(pki["client"]), str(pki["client_key"]))
    reply = _https(f"https://{cluster.replica_http}/v1/completions", context, body)
    assert reply["usage"]["completion_tokens"] == 3


def test_generate_and_top_take_tls_ca(cluster: MiniCluster, pki: dict[str, Path]):
    cli = [sys.executable, "-m", "prefixmesh.cli"]
    gen = subprocess.run(
        [*cli, "generate", "--router", cluster.router_grpc, "--tls-ca", str(pki["ca"]),
         "--max-tokens", "3", "--temperature", "0", "--ignore-eos", "hi"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert "3 tokens (length)" in gen.stderr, gen.stderr
    top = subprocess.run(
        [*cli, "top", "--router", cluster.router_grpc, "--once", "--tls-ca", str(pki["ca"]),
         "--tls-cert", str(pki["client"]), "--tls-key", str(pki["client_key"])],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert top.returncode == 0, top.stderr
    assert "tls-0" in top.stdout
    plain = subprocess.run(
        [*cli, "generate", "--router", cluster.router_grpc, "--connect-timeout", "2", "hi"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plain.returncode != 0


def test_healthcheck_speaks_tls_from_the_environment(cluster: MiniCluster, pki: dict[str, Path]):
    """What compose's and the k8s overlay's probes run, with a replica's own variables."""
    port = cluster.replica_grpc.rsplit(":", 1)[1]
    env = {
        "PATH": "/usr/bin:/bin", "PREFIXMESH_PORT": port,
        "PREFIXMESH_TLS_CERT": str(pki["replica"]), "PREFIXMESH_TLS_KEY": str(pki["replica_key"]),
        "PREFIXMESH_TLS_CLIENT_CA": str(pki["ca"]), "PREFIXMESH_TLS_CA": str(pki["ca"]),
    }  # fmt: skip
    cmd = [sys.executable, "-m", "prefixmesh.cli.healthcheck"]
    ok = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    plain = {"PATH": env["PATH"], "PREFIXMESH_PORT": port}
    refused = subprocess.run(cmd, cwd=ROOT, env=plain, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused.stdout


def test_deploy_tls_overlays_use_real_flags():
    import shutil

    import yaml

    from replica.server.config import ServerConfig
    from router.config import RouterConfig

    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.tls.yml").read_text())
    for name, config in (("replica", ServerConfig), ("router", RouterConfig)):
        service = compose["services"][name]
        assert service["healthcheck"]["test"][-2:] == ["-m", "prefixmesh.cli.healthcheck"]
        for var in service["environment"]:
            assert var.removeprefix("PREFIXMESH_").lower() in config.__dataclass_fields__, var
    assert "PREFIXMESH_TLS_CLIENT_CA" in compose["services"]["replica"]["environment"]
    if shutil.which("kubectl"):
        done = subprocess.run(
            ["kubectl", "kustomize", str(ROOT / "deploy" / "k8s-tls")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(done.stdout)
                if d and d["kind"] == "Deployment"}  # fmt: skip
        for name in ("replica", "router"):
            container = docs[name]["spec"]["template"]["spec"]["containers"][0]
            env = {e["name"] for e in container["env"]}
            assert {"PREFIXMESH_TLS_CERT", "PREFIXMESH_TLS_KEY", "PREFIXMESH_TLS_CA"} <= env
            assert "grpc" not in container["readinessProbe"]
            assert "prefixmesh.cli.healthcheck" in container["readinessProbe"]["exec"]["command"]


def test_loadtest_over_https_trusts_the_given_ca(
    cluster: MiniCluster, pki: dict[str, Path], tmp_path: Path, tiny_model_dir: Path
):
    from loadtest.cli import main as loadtest_main

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    workload = ["--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "2",
                "--system-prompt-len", "32", "--question-len", "8", "--output-len", "3",
                "--vocab-size", str(vocab), "--min-token-id", "3",
                "--rate", "inf", "--no-progress", "--no-plots"]  # fmt: skip
    url = f"https://{cluster.router_http}"
    out = tmp_path / "ok"
    assert loadtest_main(["--target", url, "--tls-ca", str(pki["ca"]), "--out", str(out),
                          *workload]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"]["sent"] == summary["requests"]["ok"] == 4
    # Without the CA the router's certificate is not trusted: nothing gets through.
    refused = tmp_path / "refused"
    rc = loadtest_main(["--target", url, "--out", str(refused), *workload])
    assert rc != 0 or json.loads((refused / "summary.json").read_text())["requests"]["ok"] == 0


def test_up_serves_every_door_over_tls(tiny_model_dir: Path, tmp_path: Path):
    """`prefixmesh up --tls-*`: clients reach the router over TLS with the CA, the router
    reaches the replicas over mutual TLS, and plaintext is refused everywhere."""
    import os
    import signal

    from helpers import free_port, wait_until

    from prefixmesh.procs import wait_serving

    pki = make_pki(tmp_path)
    port, http_port = free_port(), free_port()
    router = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXMESH_")}
    cli = [sys.executable, "-m", "prefixmesh.cli"]
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        up = subprocess.Popen(
            [*cli, "up", "--replicas", "1", "--model", str(tiny_model_dir), "--port", str(port),
             "--http-port", str(http_port), "--no-color", "--tls-cert", str(pki["router"]),
             "--tls-key", str(pki["router_key"]), "--tls-ca", str(pki["ca"]),
             "--tls-client-ca", str(pki["ca"])],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
    try:
        ca_only = TlsFiles(ca=str(pki["ca"]))
        wait_serving(router, timeout_s=300, alive=lambda: up.poll() is None, tls=ca_only)
        gen = subprocess.run(
            [*cli, "generate", "--router", router, "--tls-ca", str(pki["ca"]), "--max-tokens",
             "3", "--temperature", "0", "--ignore-eos", "hi"],
            cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr + log_path.read_text()[-2000:]
        assert "3 tokens (length)" in gen.stderr, gen.stderr
        reply = _https(
            f"https://127.0.0.1:{http_port}/v1/completions",
            ssl.create_default_context(cafile=str(pki["ca"])),
            {"prompt": "hello", "max_tokens": 2, "temperature": 0},
        )
        assert reply["usage"]["completion_tokens"] == 2
        with grpc.insecure_channel(router) as ch, pytest.raises(grpc.RpcError) as err:
            _generate(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The banner's examples carry the CA. `up` prints it once the router lists the replica,
        # which its own poll may see a moment after the requests above were served.
        banner = f"--tls-ca {pki['ca']}"
        with contextlib.suppress(TimeoutError):  # the assertion below shows the log
            wait_until([], lambda: banner in log_path.read_text(), "up's banner", timeout=60)
        output = log_path.read_text()
        assert banner in output, output[-2000:]
        replica = output.split("replica-0 is SERVING on ")[1].split()[0]
        # The replica wants the client certificate that `up` gave the router.
        with (
            grpc.secure_channel(
                replica, grpc.ssl_channel_credentials(pki["ca"].read_bytes())
            ) as ch,
            pytest.raises(grpc.RpcError) as err,
        ):
            _generate(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
