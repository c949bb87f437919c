"""The shape of the code base: no import circles, no function over 80 lines.

Both read the source with ``ast`` (nothing is imported or run), so they are fast and hold on
every machine. docs/design.md gives the map of folders these checks keep honest.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("prefixmesh", "replica", "router", "proto", "kernels", "loadtest")
MAX_FUNCTION_LINES = 80
# The Triton kernels are one straight-line program each: splitting them costs registers.
LONG_FUNCTIONS_EXEMPT_FILES = {"kernels/triton_kernels.py"}
# Functions still over the limit, each to be split by the owner of its file (then removed here).
LONG_FUNCTIONS_ALLOWED: set[tuple[str, str]] = set()


def _python_files(folders: tuple[str, ...]) -> list[Path]:
    files = [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in files if "_pb2" not in p.name]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, module: str, modules: set[str]) -> set[str]:
    """The project's modules that ``module`` imports anywhere (top level, in functions, and
    under ``TYPE_CHECKING``: a circle among type hints is still a circle for a reader)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(filter(None, (known(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else known(base) or "")
    found.discard("")
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in _python_files(PACKAGES)}
    names = set(paths)
    return {name: _imported_modules(path, name, names) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_real_edges() -> None:
    graph = import_graph()
    assert "replica.server.engine_loop" in graph["replica.server.server"]
    assert "prefixmesh.hashing" in graph["router.index"]


# The map of docs/design.md: which part of the tree may import which (besides itself).
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "proto": set(),
    "kernels": set(),
    "prefixmesh": {"proto"},  # the shared library (torch-free)
    "prefixmesh.openai": {"prefixmesh", "proto"},
    # On top of everything: each command's module is imported lazily, inside its function.
    "prefixmesh.cli": {
        "prefixmesh",
        "prefixmesh.openai",
        "proto",
        "kernels",
        "replica",
        "replica.server",
        "replica.fetch",
        "replica.bench",
        "router",
        "loadtest",
    },
    # The engine: no grpc, no Redis. Of replica.fetch it imports only ``transfer`` (torch only).
    "replica": {"prefixmesh", "kernels", "replica.fetch"},
    # Peer fetch: asker, holder, layout, transfer, warm start (the server wires it in).
    "replica.fetch": {"replica", "replica.server", "prefixmesh", "proto", "kernels"},
    # Its benchmarks: ``fetch`` runs two replica servers, so it reaches into replica.server.
    "replica.bench": {"replica", "replica.server", "prefixmesh", "proto", "kernels"},
    "replica.server": {
        "replica",
        "replica.fetch",
        "prefixmesh",
        "prefixmesh.openai",
        "proto",
        "kernels",
    },
    "router": {"prefixmesh", "prefixmesh.openai", "proto"},  # no torch
    "loadtest": {"prefixmesh", "proto", "router"},  # router: the simulator replays its policies
}


def part_of(module: str) -> str:
    """The part of the map a module belongs to (the longest matching prefix)."""
    parts = module.split(".")
    for n in (2, 1):
        name = ".".join(parts[:n])
        if name in ALLOWED_IMPORTS:
            return name
    raise KeyError(module)


def test_the_engine_takes_only_the_transfer_module_of_fetch() -> None:
    """``replica.fetch`` holds grpc and Redis code; the engine may use only its torch side."""
    graph = import_graph()
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if part_of(module) == "replica"
        for target in targets
        if part_of(target) == "replica.fetch"
        and target not in ("replica.fetch", "replica.fetch.transfer")
    )
    assert not wrong, "\n".join(wrong)


def test_every_part_imports_only_what_the_map_allows() -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if part_of(target) != part_of(module)
        and part_of(target) not in ALLOWED_IMPORTS[part_of(module)]
    )
    assert not wrong, "imports outside docs/design.md's map:\n" + "\n".join(wrong)


# The library floor: what the rest of the house stands on. It imports only the wire contract.
LIBRARY_FLOOR = ("prefixmesh", "prefixmesh.openai")
# The CLI's commands, each imported lazily by its function in prefixmesh/cli/__init__.py.
CLI_COMMAND_MODULES = {
    "prefixmesh.cli.up",
    "prefixmesh.cli.generate",
    "prefixmesh.cli.top",
    "replica.server",
    "router.server",
    "loadtest.cli",
    "replica.bench",
}
# Imports hidden in strings (importlib, __import__), which no import graph sees. Each one here is
# a debt: replica/bench imports its benchmarks by name from its BENCHMARKS list.
HIDDEN_IMPORTS_ALLOWED = {"replica/bench/__init__.py"}


def test_the_graph_sees_every_cli_command() -> None:
    """The CLI's lazy imports are plain imports, so they are edges of the graph like any other."""
    assert CLI_COMMAND_MODULES <= import_graph()["prefixmesh.cli"]


def test_the_cli_is_on_top_and_the_floor_imports_nothing_above_it() -> None:
    graph = import_graph()
    into_cli = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if part_of(module) != "prefixmesh.cli"
        for target in targets
        if part_of(target) == "prefixmesh.cli"
    )
    assert not into_cli, (
        "only the CLI may import the CLI (move what they need into the library):\n"
        + ("\n".join(into_cli))
    )
    above_floor = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if part_of(module) in LIBRARY_FLOOR
        for target in targets
        if part_of(target) not in (*LIBRARY_FLOOR, "proto")
    )
    assert not above_floor, "the library floor imports what stands on it:\n" + "\n".join(
        above_floor
    )


def hidden_imports() -> set[str]:
    """Files that import a module named in a string (``importlib.import_module``,
    ``__import__``): edges the import graph cannot see."""
    found = set()
    for path in _python_files(PACKAGES):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = node.func if isinstance(node, ast.Call) else None
            name = getattr(func, "attr", None) or getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_no_import_is_hidden_in_a_string() -> None:
    hidden = hidden_imports() - HIDDEN_IMPORTS_ALLOWED
    assert not hidden, "import these modules by a plain (lazy if need be) import:\n" + "\n".join(
        sorted(hidden)
    )
    stale = HIDDEN_IMPORTS_ALLOWED - hidden_imports()
    assert not stale, f"no hidden import left: remove from HIDDEN_IMPORTS_ALLOWED: {sorted(stale)}"


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles (break each by moving what both sides need):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, str, int]]:
    found = []
    for path in _python_files((*PACKAGES, "tests")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in LONG_FUNCTIONS_EXEMPT_FILES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append((rel, node.name, lines))
    return found


def test_no_function_over_80_lines() -> None:
    found = long_functions()
    too_long = [f for f in found if f[:2] not in LONG_FUNCTIONS_ALLOWED]
    assert not too_long, "split these functions (at most 80 lines each):\n" + "\n".join(
        f"{path}: {name} ({lines} lines)" for path, name, lines in too_long
    )
    stale = LONG_FUNCTIONS_ALLOWED - {f[:2] for f in found}
    assert not stale, f"now short enough: remove from LONG_FUNCTIONS_ALLOWED: {sorted(stale)}"
