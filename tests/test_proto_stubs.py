"""The committed gRPC stubs are what ``python -m proto.build`` makes of proto/prefixmesh.proto."""

from __future__ import annotations

from pathlib import Path

from proto import build

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto(tmp_path):
    build.generate(tmp_path)
    made = sorted(p.name for p in (tmp_path / "proto").iterdir())
    assert made == ["prefixmesh_pb2.py", "prefixmesh_pb2.pyi", "prefixmesh_pb2_grpc.py"]
    for name in made:
        committed = (ROOT / "proto" / name).read_text()
        assert (tmp_path / "proto" / name).read_text() == committed, (
            f"proto/{name} is stale: run `python -m proto.build` and commit the result"
        )
