"""``prefixmesh <command> [flags]``: one entry point on top of the whole code base.

The CLI is the one room above every other: it may import the router, the replica, the load
tester and the benchmarks, and nothing imports it (``tests/test_structure.py`` checks both).

Adding a command: write a function that imports the command's module *inside its body* (a
plain ``from ... import main``, so the structure test and any import-graph tool see the edge,
and ``prefixmesh router`` never imports torch), calls its ``main(argv)`` and returns the exit
status; then add one line to ``COMMANDS``::

    def _tune(argv: list[str]) -> int:
        from replica.tune import main

        return main(argv)

    COMMANDS["tune"] = Command(_tune, "pick engine settings for this machine")

No ``importlib`` and no module names in strings: an import nobody can see is a layering rule
nobody can check.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    """One ``prefixmesh`` command: the function that runs it and its one-line help."""

    run: Callable[[list[str]], int | None]
    help: str


def _up(argv: list[str]) -> int | None:
    from prefixmesh.cli.up import main

    return main(argv)


def _replica(argv: list[str]) -> int | None:
    from replica.server import main

    return main(argv)


def _router(argv: list[str]) -> int | None:
    from router.server import main

    return main(argv)


def _generate(argv: list[str]) -> int | None:
    from prefixmesh.cli.generate import main

    return main(argv)


def _top(argv: list[str]) -> int | None:
    from prefixmesh.cli.top import main

    return main(argv)


def _loadtest(argv: list[str]) -> int | None:
    from loadtest.cli import main

    return main(argv)


def _bench(argv: list[str]) -> int | None:
    from replica.bench import main

    return main(argv)


def _tune(argv: list[str]) -> int | None:
    from loadtest.tune import main

    return main(argv)


COMMANDS: dict[str, Command] = {
    "up": Command(_up, "run Redis, N replicas and the router on this machine"),
    "replica": Command(_replica, "serve one model replica over gRPC"),
    "router": Command(_router, "serve the KV-cache-aware router over gRPC"),
    "generate": Command(_generate, "send one prompt to the router and stream the answer"),
    "top": Command(_top, "live view of every replica's hit rate and load"),
    "loadtest": Command(_loadtest, "replay traces or synthetic workloads against the cluster"),
    "bench": Command(_bench, "offline throughput benchmark of the replica engine"),
    "tune": Command(_tune, "search engine knobs on a workload against an SLO and a budget"),
}


def _usage() -> str:
    lines = ["usage: prefixmesh <command> [flags]   (prefixmesh <command> --help)", ""]
    lines += [f"  {name:<10} {command.help}" for name, command in COMMANDS.items()]
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
    return int(COMMANDS[name].run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
