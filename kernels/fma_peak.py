"""The CPU's measured float32 FMA peak, the ceiling any matmul on it can reach.

A tiny C loop keeps ten independent AVX2 FMA chains per thread busy (enough to cover the FMA
latency on every current x86 core), on as many OpenMP threads as torch uses, and reports the
floating-point operations per second it sustained. Compiled once with the system C compiler
into ``~/.cache/prefixmesh/kernels`` and called through ctypes. Only for x86 CPUs with AVX2 and
FMA and a compiler that builds it; elsewhere :func:`fma_peak_gflops` returns ``None``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from kernels.cpu_flags import cpu_flags

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>

/* GFLOP/s of `iters` rounds of 10 independent 8-wide FMAs on each of `threads` threads. */
double fma_gflops(long iters, int threads) {
  volatile float sink = 0.f;
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {
    const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    __m256 a0 = _mm256_set1_ps(0.f), a1 = _mm256_set1_ps(1.f), a2 = _mm256_set1_ps(2.f),
           a3 = _mm256_set1_ps(3.f), a4 = _mm256_set1_ps(4.f), a5 = _mm256_set1_ps(5.f),
           a6 = _mm256_set1_ps(6.f), a7 = _mm256_set1_ps(7.f), a8 = _mm256_set1_ps(8.f),
           a9 = _mm256_set1_ps(9.f);
    for (long n = 0; n < iters; ++n) {
      a0 = _mm256_fmadd_ps(a0, b, c); a1 = _mm256_fmadd_ps(a1, b, c);
      a2 = _mm256_fmadd_ps(a2, b, c); a3 = _mm256_fmadd_ps(a3, b, c);
      a4 = _mm256_fmadd_ps(a4, b, c); a5 = _mm256_fmadd_ps(a5, b, c);
      a6 = _mm256_fmadd_ps(a6, b, c); a7 = _mm256_fmadd_ps(a7, b, c);
      a8 = _mm256_fmadd_ps(a8, b, c); a9 = _mm256_fmadd_ps(a9, b, c);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(a8, a9));
    float out[8];
    _mm256_storeu_ps(out, s);
    #pragma omp atomic
    sink += out[0];  /* keeps the chains alive */
  }
  double seconds = omp_get_wtime() - start;
  return 2.0 * 8 * 10 * (double)iters * threads / seconds / 1e9;
}
"""


def _library() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if not {"avx2", "fma"} <= (cpu_flags() or frozenset()):
        return None
    cache = Path(os.environ.get("PREFIXMESH_CACHE", Path.home() / ".cache" / "prefixmesh"))
    digest = hashlib.sha1(_SOURCE.encode()).hexdigest()[:12]
    lib = cache / "kernels" / f"fma_peak_{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        src = lib.with_suffix(".c")
        src.write_text(_SOURCE)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
        try:
            subprocess.run(
                [compiler, *flags, str(src), "-o", str(tmp)], check=True, capture_output=True
            )
        except (OSError, subprocess.CalledProcessError):  # e.g. a compiler without OpenMP
            return None
        tmp.replace(lib)  # atomic: a concurrent run never loads a half-written file
    handle = ctypes.CDLL(str(lib))
    handle.fma_gflops.argtypes = [ctypes.c_long, ctypes.c_int]
    handle.fma_gflops.restype = ctypes.c_double
    return handle


def fma_peak_gflops(threads: int, iters: int = 50_000_000, repeats: int = 3) -> float | None:
    """Best of ``repeats`` runs of the FMA loop on ``threads`` threads, in GFLOP/s."""
    lib = _library()
    if lib is None:
        return None
    return max(lib.fma_gflops(iters, threads) for _ in range(repeats))
