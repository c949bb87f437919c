"""``prefixmesh <command> [flags]``: one entry point, each command in its own module."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# command -> (module, one-line help). Modules are imported lazily so that the router's commands
# never import torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("prefixmesh.cli.up", "run Redis, N replicas and the router on this machine"),
    "replica": ("replica.server", "serve one model replica over gRPC"),
    "router": ("router.server", "serve the KV-cache-aware router over gRPC"),
    "generate": ("prefixmesh.cli.generate", "send one prompt to the router and stream the answer"),
    "top": ("prefixmesh.cli.top", "live view of every replica's hit rate and load"),
    "loadtest": ("loadtest.cli", "replay traces or synthetic workloads against the cluster"),
    "bench": ("replica.bench", "offline throughput benchmark of the replica engine"),
    "tune": ("loadtest.tune", "search engine knobs on a workload against an SLO and a budget"),
}


def _usage() -> str:
    lines = ["usage: prefixmesh <command> [flags]   (prefixmesh <command> --help)", ""]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def checkout_first() -> None:
    """Run from a source checkout (an editable install, or ``python -m`` elsewhere), put the
    checkout first on ``sys.path``. An editable install appends it after site-packages, where
    Hugging Face's ``kernels`` distribution (which newer transformers require) takes the import
    name of our ``kernels/`` package: ``prefixmesh bench`` and the replica then failed with
    "cannot import name 'get_backend' from 'kernels'"."""
    root = Path(__file__).resolve().parents[2]
    checkout = (root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file()
    if checkout and sys.path[:1] != [str(root)]:  # not site-packages of a wheel install
        sys.path.insert(0, str(root))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    checkout_first()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"prefixmesh: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
