"""The C++ CPU kernels (kernels/csrc/cpu_ops.cpp), built once per ISA with the system compiler.

One source, written against ATen's portable vectors, compiled for the widest ISA this CPU has
(or ``PREFIXMESH_CPU_ISA`` allows, see kernels/cpu_flags.py): AMX (the AVX-512 build whose
bfloat16 decode attention scores keys on the tile unit), AVX-512, AVX2, or plain C++
(``generic``, what ARM and pre-AVX2 CPUs get). Each build carries explicit ISA flags, never
``-march=native``, so a build for one ISA runs on every CPU that has it, and a machine can
build and test every ISA it supports.

The first build takes about a minute (cached under ``~/.cache/torch_extensions``). Where no
compiler is available, or with ``PREFIXMESH_CPU_KERNELS=0``, :func:`load` returns ``None`` and
callers use their torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType

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

# A build lock older than this is left over from a killed builder (see _clear_stale_lock).
STALE_LOCK_S = 900.0

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}


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


def _build(target: str) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load as load_extension

        # -fopenmp: at::parallel_for only splits work across threads in a translation unit
        # built with OpenMP; the extension then shares torch's own libgomp, so
        # torch.set_num_threads governs it too. The name carries a digest of the source, its
        # path and the flags, so an edited source or another ISA never reuses a stale build,
        # and two checkouts on one machine do not rebuild over each other (torch's builder
        # recompiles whenever the source's path in its build file changes).
        flags = ["-O3", "-fopenmp", *BUILD_FLAGS[target]]
        files = (*SOURCES, *HEADERS)
        key = "".join(f"{src.resolve()}\n{src.read_text()}" for src in files) + " ".join(flags)
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        name = f"prefixmesh_cpu_ops_{target}_{digest}"
        _clear_stale_lock(name)
        return load_extension(
            name,
            sources=[str(src) for src in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers: the torch path still works
        log.warning("CPU kernels (%s) unavailable (%s); using the torch path", target, exc)
        return None


def _clear_stale_lock(name: str) -> None:
    """Remove a build lock nobody is working under any more.

    torch's builder marks a build in progress with a ``lock`` file in its folder, and every
    other process waits, without a time limit, for it to go. A builder killed mid-build (kill -9
    of a starting replica, a test timeout) leaves the file behind, and every later load would
    then wait forever. A build takes a minute or two; a lock untouched for longer than
    :data:`STALE_LOCK_S` is left over."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:  # a torch that lays its builds out otherwise: nothing to clear
        return
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


def build_all() -> dict[str, float | None]:
    """Build every ISA this CPU runs, one after another; seconds each took (``None``: failed).

    The test suite calls it once before its first test, so that compiling never runs inside a
    test's time limit or in several processes at once."""
    from kernels.cpu_flags import supported_isas

    seconds: dict[str, float | None] = {}
    for target in sorted({build_isa(isa) for isa in supported_isas()}):
        start = time.perf_counter()
        module = load(target)
        seconds[target] = time.perf_counter() - start if module is not None else None
    return seconds


if __name__ == "__main__":
    for target, took in build_all().items():
        state = f"ready in {took:.1f} s" if took is not None else "unavailable (torch path)"
        print(f"CPU kernels {target}: {state}")
