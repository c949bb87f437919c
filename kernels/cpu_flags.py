"""The CPU's feature flags (``avx2``, ``fma``, ``avx512_bf16``, ``amx_bf16``, ...), read once.

The engine picks its default dtype from them, the C++ decode kernel names its build after them
(a ``-march=native`` build is never reused on another CPU), and ``prefixmesh bench peak`` runs
only where AVX2 + FMA exist. Linux only (``/proc/cpuinfo``); elsewhere the flags are unknown.
"""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The flags of the first CPU listed in ``cpuinfo``; ``None`` where there is no such file."""
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()
