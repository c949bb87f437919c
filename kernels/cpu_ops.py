"""The C++ CPU kernels (kernels/csrc/cpu_ops.cpp), built once per ISA with the system compiler.

One source, written against ATen's portable vectors, compiled for the widest ISA this CPU has
(or ``PREFIXMESH_CPU_ISA`` allows, see kernels/cpu_flags.py): AMX (the AVX-512 build whose
bfloat16 decode attention scores keys on the tile unit), AVX-512, AVX2, or plain C++
(``generic``, what ARM and pre-AVX2 CPUs get). Each build carries explicit ISA flags, never
``-march=native``, so a build for one ISA runs on every CPU that has it, and a machine can
build and test every ISA it supports.

The first build takes about a minute (kept under ``PREFIXMESH_KERNEL_DIR``, default
``~/.cache/torch_extensions``) and is never redone: a finished build is imported directly, and a
build runs under a lock that dies with its holder (kernels/build_lock.py), so a builder killed
mid-build never makes a later start wait. ``python -m kernels.cpu_ops --all`` builds every ISA
(what the replica image does at build time). Where no compiler is available, or with
``PREFIXMESH_CPU_KERNELS=0``, :func:`load` returns ``None`` and callers use their torch path,
which the log says loudly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType

from kernels.build_lock import BuildLock
from kernels.cpu_flags import ISA_LEVELS, cpu_isa

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# Compiled into the same module: the linear layers' own GEMMs (kernels/cpu_linear.py), bfloat16
# on AVX-512 BF16 and float32 on FMA vectors.
SOURCES = (SOURCE, SOURCE.parent / "pair_gemm.cpp", SOURCE.parent / "panel_gemm.cpp")
# Included by the sources (elementwise.h twice: docs/kernels.md); part of the build's digest.
HEADERS = tuple(SOURCE.parent / h for h in ("elementwise.h", "output.h", "prefetch.h"))
_X86 = platform.machine() in ("x86_64", "AMD64")
_COMMON_X86 = ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt"]
# What ATen passes when it compiles its own kernels for each capability.
BUILD_FLAGS = {
    "generic": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"]
    + (["-mno-avx", "-mno-avx2", "-mno-fma", "-mno-avx512f"] if _X86 else []),
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", *_COMMON_X86],
    "avx512": [
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        *_COMMON_X86,
    ],
}
# AMX: the AVX-512 build plus the tile unit, which scores bfloat16 decode attention's keys.
BUILD_FLAGS["amx"] = [*BUILD_FLAGS["avx512"], "-mamx-tile", "-mamx-bf16", "-DPM_AMX"]

# Where builds live: one folder per build name. The replica image bakes every ISA's build into
# /opt/prefixmesh/kernels at image build time (deploy/Dockerfile.replica).
KERNEL_DIR_ENV = "PREFIXMESH_KERNEL_DIR"
# Written last, after a build imported: a folder holding it is never built again.
DONE_MARK = "prefixmesh-built"

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}
# What each build loaded: "prebuilt" (found built), "built" (compiled here) or "unavailable".
_origins: dict[str, str] = {}


def build_isa(isa: str | None = None) -> str:
    """The build that serves ``isa`` (default: what this CPU, capped, runs)."""
    isa = isa or cpu_isa()
    if isa not in ISA_LEVELS:
        raise ValueError(f"isa must be one of {ISA_LEVELS} (got {isa!r})")
    if not _X86:
        return "generic"
    return isa


def load(isa: str | None = None) -> ModuleType | None:
    """The compiled module for ``isa`` (see :func:`build_isa`), or ``None`` when it cannot be
    built here or kernels are turned off."""
    if os.environ.get("PREFIXMESH_CPU_KERNELS", "1") == "0":
        return None
    target = build_isa(isa)
    with _lock:
        if target not in _modules:
            _modules[target] = _build(target)
        return _modules[target]


def describe(isa: str | None = None) -> str:
    """The build serving ``isa``, as a replica reports it: ``cpu_ops avx512 (prebuilt)``, or
    ``torch path (...)`` with the reason, after :func:`load`."""
    if os.environ.get("PREFIXMESH_CPU_KERNELS", "1") == "0":
        return "torch path (PREFIXMESH_CPU_KERNELS=0)"
    target = build_isa(isa)
    origin = _origins.get(target)
    if origin is None:
        return f"cpu_ops {target} (not loaded)"
    if origin == "unavailable":
        return f"torch path (cpu_ops {target} unavailable)"
    return f"cpu_ops {target} ({origin})"


def build_name(target: str) -> tuple[str, list[str]]:
    """The build's name and compiler flags. The name carries a digest of the sources, their
    path and the flags, so an edited source or another ISA never reuses a stale build, and two
    checkouts on one machine do not rebuild over each other (torch's builder recompiles whenever
    the source's path in its build file changes)."""
    # -fopenmp: at::parallel_for only splits work across threads in a translation unit built
    # with OpenMP; the extension then shares torch's own libgomp, so torch.set_num_threads
    # governs it too.
    flags = ["-O3", "-fopenmp", *BUILD_FLAGS[target]]
    files = (*SOURCES, *HEADERS)
    key = "".join(f"{src.resolve()}\n{src.read_text()}" for src in files) + " ".join(flags)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return f"prefixmesh_cpu_ops_{target}_{digest}", flags


def build_dir(name: str) -> Path:
    """The folder of build ``name``: under ``PREFIXMESH_KERNEL_DIR`` when set, else torch's own
    (``~/.cache/torch_extensions/...``)."""
    root = os.environ.get(KERNEL_DIR_ENV, "").strip()
    if root:
        return Path(root) / name
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _build(target: str) -> ModuleType | None:
    try:
        name, flags = build_name(target)
        folder = build_dir(name)
        if (folder / DONE_MARK).exists():  # built before: no compiler, no lock, no wait
            module = _import(name, folder)
            _origins[target] = "prebuilt"
        else:
            module, _origins[target] = _compile(name, folder, flags)
        log.info("CPU kernels: %s from %s", describe(target), folder)
        return module
    except Exception as exc:  # no compiler, no headers: the torch path still works
        _origins[target] = "unavailable"
        log.error(
            "CPU KERNELS (%s) UNAVAILABLE (%s): USING THE TORCH PATH, several times slower "
            "(docs/kernels.md; the replica image ships them prebuilt)", target, exc,
        )  # fmt: skip
        return None


def _compile(name: str, folder: Path, flags: list[str]) -> tuple[ModuleType, str]:
    from torch.utils.cpp_extension import load as load_extension

    with BuildLock(folder):
        if (folder / DONE_MARK).exists():  # the process we waited on built it
            return _import(name, folder), "prebuilt"
        folder.mkdir(parents=True, exist_ok=True)
        log.info("building CPU kernels %s (about a minute, once)", name)
        module = load_extension(
            name,
            sources=[str(src) for src in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
        (folder / DONE_MARK).write_text(f"{name}\n")
        return module, "built"


def _import(name: str, folder: Path) -> ModuleType:
    path = folder / f"{name}.so"  # what torch's builder names it (cpp_extension.LIB_EXT)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no loadable module at {path}")
    import torch  # noqa: F401  (the module links against torch's libraries)

    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_all(every_isa: bool = False) -> dict[str, float | None]:
    """Build every ISA this CPU runs (``every_isa``: every ISA there is, for an image that
    will run on other CPUs), one after another; seconds each took (``None``: failed).

    The test suite calls it once before its first test, so that compiling never runs inside a
    test's time limit or in several processes at once."""
    from kernels.cpu_flags import supported_isas

    isas = BUILD_FLAGS if every_isa else supported_isas()
    seconds: dict[str, float | None] = {}
    for target in sorted({build_isa(isa) for isa in isas}):
        start = time.perf_counter()
        module = load(target)
        seconds[target] = time.perf_counter() - start if module is not None else None
    return seconds


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the C++ CPU kernels ahead of time.")
    parser.add_argument(
        "--all", action="store_true", help="every ISA, not only this CPU's (default: off)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = build_all(every_isa=args.all)
    for target, took in results.items():
        state = f"ready in {took:.1f} s" if took is not None else "unavailable (torch path)"
        print(f"CPU kernels {target}: {state}")
    raise SystemExit(0 if all(t is not None for t in results.values()) else 1)
