"""Regenerate proto/prefixmesh_pb2.py and prefixmesh_pb2_grpc.py from proto/prefixmesh.proto.

Run from anywhere: ``python -m proto.build``. Needs grpcio-tools (a dev dependency); the
generated files are committed so that installs need no protoc, and a test checks they match.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        str(ROOT / "proto" / "prefixmesh.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(ROOT)
    sys.exit(0)
