"""The committed gRPC stubs are what ``python -m proto.build`` makes of proto/prefixmesh.proto,
and the versions they were generated with are the ones the project pins and requires."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement

from proto import build

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto(tmp_path):
    build.generate(tmp_path)
    made = sorted(p.name for p in (tmp_path / "proto").iterdir())
    assert made == ["prefixmesh_pb2.py", "prefixmesh_pb2.pyi", "prefixmesh_pb2_grpc.py"]
    for name in made:
        committed = (ROOT / "proto" / name).read_text()
        assert (tmp_path / "proto" / name).read_text() == committed, (
            f"proto/{name} is stale: run `python -m proto.build` and commit the result "
            "(with grpcio-tools as constraints.txt pins it)"
        )


def _generated_versions() -> tuple[str, str]:
    """The grpcio and protobuf versions the committed stubs were generated with."""
    grpc_code = (ROOT / "proto" / "prefixmesh_pb2_grpc.py").read_text()
    pb2_code = (ROOT / "proto" / "prefixmesh_pb2.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_code).group(1)
    protobuf_version = re.search(r"# Protobuf Python Version: ([\d.]+)", pb2_code).group(1)
    return grpc_version, protobuf_version


def test_pins_and_floors_are_the_versions_that_generated_the_stubs():
    # The stubs refuse to import under an older grpcio or protobuf than generated them, so the
    # project's floors must be those versions; CI regenerates them with the pinned grpcio-tools,
    # which must be the one that wrote them (a newer one writes its own version in: CI failed
    # on a clean install the day grpcio-tools 1.85.4 came out).
    grpc_version, protobuf_version = _generated_versions()
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; we support 3.10)
    block = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    floors = {}
    for line in re.findall(r'^\s*"([^"]+)",', block, re.M):
        req = Requirement(line)
        floors[req.name] = {s.version for s in req.specifier if s.operator == ">="}
    assert floors["grpcio"] == {grpc_version}, "pyproject's grpcio floor"
    assert floors["protobuf"] == {protobuf_version}, "pyproject's protobuf floor"
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins.get("grpcio-tools") == grpc_version, "constraints.txt's grpcio-tools pin"
