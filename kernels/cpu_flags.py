"""The CPU's feature flags and ISA level, read once, and the switch that caps them.

The engine picks its default dtype from them, the C++ CPU kernels pick the vector width they
are built for, and ``prefixmesh bench peak`` picks the FMA loop it measures. Linux only
(``/proc/cpuinfo``); elsewhere the flags are unknown and the level is ``generic``.

The project runs on three kinds of x86 machine (AVX2 only; AVX-512 with AVX-512 BF16; AVX-512
with AMX), so every ISA-dependent path must be testable on any of them. ``PREFIXMESH_CPU_ISA``
(``generic``, ``avx2``, ``avx512`` or ``amx``) caps what this module reports: under
``PREFIXMESH_CPU_ISA=avx2`` an AMX machine reports no AVX-512 or AMX flag, so it picks float32,
builds the AVX2 kernels and measures the AVX2 peak, exactly as an AVX2 machine would. A cap can
only take features away: asking for more than the CPU has changes nothing.

Torch's own kernels choose their ISA themselves. :func:`torch_env` gives the environment
variables that cap them too (oneDNN's ``ONEDNN_MAX_CPU_ISA``, ATen's ``ATEN_CPU_CAPABILITY``);
both are read when torch first runs a kernel. :func:`cap_torch` sets them from the cap in this
process; the test suite (tests/conftest.py), ``prefixmesh bench`` and the replica server call it
first thing, so under a cap the GEMMs run on the capped ISA as well.
"""

from __future__ import annotations

import functools
import os

ISA_ENV = "PREFIXMESH_CPU_ISA"
# From narrowest to widest. Each level's flags (beyond the previous level's) are what the
# project's code paths test for.
ISA_LEVELS = ("generic", "avx2", "avx512", "amx")
_LEVEL_FLAGS = {
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "amx": frozenset({"amx_tile", "amx_bf16"}),
}
# Flags that exist only from a level on: removed when the cap is below that level.
_FLAG_PREFIXES = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx512",), "amx": ("amx",)}
# What oneDNN and ATen call each level (their own ISA caps).
_ONEDNN_ISA = {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_BF16",
               "amx": "AVX512_CORE_AMX"}  # fmt: skip
_ATEN_CAPABILITY = {"generic": "default", "avx2": "avx2", "avx512": "avx512", "amx": "avx512"}


@functools.cache
def _read_flags(cpuinfo: str) -> frozenset[str] | None:
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def isa_cap() -> str | None:
    """The level ``PREFIXMESH_CPU_ISA`` asks for, or ``None`` when unset.

    Raises ``ValueError`` naming the allowed values for anything else."""
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    if not cap:
        return None
    if cap not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)} (got {cap!r})")
    return cap


def native_isa(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The widest level this CPU supports, whatever the cap."""
    return _level(_read_flags(cpuinfo) or frozenset())


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The flags of the first CPU listed in ``cpuinfo``, less those above the ISA cap;
    ``None`` where there is no such file."""
    flags = _read_flags(cpuinfo)
    cap = isa_cap()
    if flags is None or cap is None:
        return flags
    above = ISA_LEVELS[ISA_LEVELS.index(cap) + 1 :]
    prefixes = tuple(p for level in above for p in _FLAG_PREFIXES[level])
    return frozenset(f for f in flags if not f.startswith(prefixes))


def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The level the project's code paths use here: the CPU's, lowered by the cap."""
    return _level(cpu_flags(cpuinfo) or frozenset())


def supported_isas(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """Every level this CPU can run, narrowest first (the caps a test can force here)."""
    native = native_isa(cpuinfo)
    return ISA_LEVELS[: ISA_LEVELS.index(native) + 1]


def torch_env(isa: str) -> dict[str, str]:
    """Environment variables that cap torch's own kernels (oneDNN, ATen) at ``isa`` too."""
    return {
        ISA_ENV: isa,
        "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[isa],
        "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[isa],
    }


def cap_torch() -> None:
    """Under ``PREFIXMESH_CPU_ISA``, cap torch's own kernels in this process too. Call it before
    torch runs its first kernel; variables the user set explicitly win."""
    cap = isa_cap()
    if cap is not None:
        for name, value in torch_env(cap).items():
            os.environ.setdefault(name, value)


def _level(flags: frozenset[str]) -> str:
    level = "generic"
    for name in ISA_LEVELS[1:]:
        if not _LEVEL_FLAGS[name] <= flags:
            break
        level = name
    return level
