"""Shared fixtures: a tiny random Llama (fast tier), the real SmolLM2 (slow tier), and Redis."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests import the repo's packages (replica, router, ...) and tests/helpers.py directly.
ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from helpers import make_tiny_model_dir, start_redis  # noqa: E402

from kernels.cpu_flags import cap_torch  # noqa: E402

# Under PREFIXMESH_CPU_ISA the whole run plays the capped machine, torch's GEMMs included.
cap_torch()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the C++ CPU kernels for every ISA this CPU runs before the first test: one compile
    each, outside any test's time limit, and before any test starts replica processes that
    would otherwise compile them at the same time. In a child process with a time limit, so a
    compiler that hangs cannot hang the run; the tests then load the cached builds."""
    import subprocess

    try:
        built = subprocess.run([sys.executable, "-m", "kernels.cpu_ops"], cwd=ROOT,
                               capture_output=True, text=True, timeout=1800)  # fmt: skip
        report = built.stdout + built.stderr[-2000:]
    except subprocess.TimeoutExpired:
        report = "CPU kernels: the build did not finish in 30 minutes\n"
    print("\n" + report.strip(), file=sys.stderr)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama HF folder (2 layers, GQA 4/2 heads, ~500-token BPE vocab)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model_files(tiny_model_dir: Path):
    from replica.loader import resolve_model

    return resolve_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def smollm2_files():
    """The real SmolLM2-135M-Instruct (downloaded and converted once into the user cache)."""
    from replica.loader import resolve_model

    return resolve_model("smollm2")


@pytest.fixture
def redis_server() -> Iterator[str]:
    """A real redis-server on a free loopback port; yields its URL."""
    handle = start_redis()
    try:
        yield handle.url
    finally:
        handle.stop()
