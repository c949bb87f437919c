"""The CPU's measured arithmetic peak, per unit: the ceiling any matmul on that unit can reach.

Units, by what an x86 CPU has (and ``PREFIXMESH_CPU_ISA`` allows, kernels/cpu_flags.py):

- ``avx2-fma``: 8-wide float32 FMAs (every x86 CPU this project runs on);
- ``avx512-fma``: 16-wide float32 FMAs (AVX-512 machines; float32 GEMMs run here there);
- ``avx512-bf16``: ``vdpbf16ps``, 32 bfloat16 products a instruction (AVX-512 BF16 machines;
  oneDNN's bfloat16 GEMMs run here where there is no AMX);
- ``amx-bf16``: AMX tiles, ``tdpbf16ps`` on six independent 16 x 16 float32 accumulator
  tiles (16 x 16 x 32 bfloat16 products each), after asking the Linux kernel for the tile state
  (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, as oneDNN does).

The loops keep 12 (AVX2) or 16 (AVX-512) independent accumulator chains per thread busy
(enough to cover latency times throughput on every current x86 core) on as many OpenMP threads
as torch uses, after a warm-up run (Zen 5 runs 512-bit work at part speed for its first
moments). They are compiled once with the system C compiler into
``~/.cache/prefixmesh/kernels`` (function-level target attributes, so one library holds every
loop) and called through ctypes. Elsewhere (no x86, no compiler) a loop unit is ``None``.
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

# unit -> (C function, flags it needs)
LOOP_UNITS = {
    "avx2-fma": ("fma_avx2", {"avx2", "fma"}),
    "avx512-fma": ("fma_avx512", {"avx512f"}),
    "avx512-bf16": ("dpbf16_avx512", {"avx512f", "avx512_bf16"}),
    "amx-bf16": ("amx_bf16", {"amx_tile", "amx_bf16"}),
}

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Independent accumulator chains: enough to cover latency x throughput on current cores (Zen 5
   issues two 512-bit vdpbf16ps a cycle at a latency of 6: 12 in flight). AVX2 has 16 registers,
   so 12 chains plus the two constants; AVX-512 has 32. */
#define CHAINS12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define CHAINS16(X) CHAINS12(X) X(12) X(13) X(14) X(15)

/* Each function: GFLOP/s of `iters` rounds of independent vector ops on `threads` threads. */
__attribute__((target("avx2,fma"))) double fma_avx2(long iters, int threads) {
  volatile float sink = 0.f;
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {
    const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
#define DECL(i) __m256 a##i = _mm256_set1_ps((float)i);
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, b, c);
#define SUM(i) s = _mm256_add_ps(s, a##i);
    CHAINS12(DECL)
    for (long n = 0; n < iters; ++n) { CHAINS12(STEP) }
    __m256 s = _mm256_setzero_ps();
    CHAINS12(SUM)
    float out[8];
    _mm256_storeu_ps(out, s);
    #pragma omp atomic
    sink += out[0];  /* keeps the chains alive */
#undef DECL
#undef STEP
#undef SUM
  }
  return 2.0 * 8 * 12 * (double)iters * threads / (omp_get_wtime() - start) / 1e9;
}

__attribute__((target("avx512f"))) double fma_avx512(long iters, int threads) {
  volatile float sink = 0.f;
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {
    const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
#define DECL(i) __m512 a##i = _mm512_set1_ps((float)i);
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, b, c);
#define SUM(i) s = _mm512_add_ps(s, a##i);
    CHAINS16(DECL)
    for (long n = 0; n < iters; ++n) { CHAINS16(STEP) }
    __m512 s = _mm512_setzero_ps();
    CHAINS16(SUM)
    #pragma omp atomic
    sink += _mm512_reduce_add_ps(s);
#undef DECL
#undef STEP
#undef SUM
  }
  return 2.0 * 16 * 16 * (double)iters * threads / (omp_get_wtime() - start) / 1e9;
}

/* vdpbf16ps: each of 16 float32 lanes accumulates two bfloat16 products (4 flops a lane). */
__attribute__((target("avx512f,avx512bf16"))) double dpbf16_avx512(long iters, int threads) {
  volatile float sink = 0.f;
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {
    const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80);  /* 1.0 in bfloat16 */
    const __m512bh c = (__m512bh)_mm512_set1_epi16(0x3380);  /* ~6e-8 */
#define DECL(i) __m512 a##i = _mm512_set1_ps((float)i);
#define STEP(i) a##i = _mm512_dpbf16_ps(a##i, b, c);
#define SUM(i) s = _mm512_add_ps(s, a##i);
    CHAINS16(DECL)
    for (long n = 0; n < iters; ++n) { CHAINS16(STEP) }
    __m512 s = _mm512_setzero_ps();
    CHAINS16(SUM)
    #pragma omp atomic
    sink += _mm512_reduce_add_ps(s);
#undef DECL
#undef STEP
#undef SUM
  }
  return 4.0 * 16 * 16 * (double)iters * threads / (omp_get_wtime() - start) / 1e9;
}

/* AMX: tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into a 16 x 16 float32
   tile (2 * 16 * 16 * 32 flops). Six independent accumulators (more than latency / throughput
   of the tile unit) and one A and one B tile. The
   tile registers are off until the process asks Linux for them; -1 if it refuses. */
struct tile_config {
  unsigned char palette_id, start_row, reserved[14];
  unsigned short colsb[16];
  unsigned char rows[16];
};

__attribute__((target("amx-tile,amx-bf16"))) double amx_bf16(long iters, int threads) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
    return -1.0;
  volatile float sink = 0.f;
  double start = omp_get_wtime();
  #pragma omp parallel num_threads(threads)
  {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; ++i) {
      cfg.colsb[i] = 64;
      cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    unsigned short ab[16 * 32];
    for (int i = 0; i < 16 * 32; ++i) ab[i] = 0x3380;  /* ~6e-8 in bfloat16 */
    float c[16 * 16];
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
    _tile_loadd(6, ab, 64); _tile_loadd(7, ab, 64);
    for (long n = 0; n < iters; ++n) {
      _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7);
      _tile_dpbf16ps(3, 6, 7); _tile_dpbf16ps(4, 6, 7); _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(0, c, 64);
    _tile_release();
    #pragma omp atomic
    sink += c[0];
  }
  return 2.0 * 16 * 16 * 32 * 6 * (double)iters * threads / (omp_get_wtime() - start) / 1e9;
}
"""


# One round of the AMX loop is 6 tile products of 16 cycles each, where the other loops'
# rounds take a cycle or two: fewer rounds for the same time.
LOOP_ITERS_DIVISOR = {"amx-bf16": 48}


def _library() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    cache = Path(os.environ.get("PREFIXMESH_CACHE", Path.home() / ".cache" / "prefixmesh"))
    digest = hashlib.sha1(_SOURCE.encode()).hexdigest()[:12]
    lib = cache / "kernels" / f"fma_peak_{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        src = lib.with_suffix(".c")
        src.write_text(_SOURCE)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        flags = ["-O2", "-fopenmp", "-shared", "-fPIC"]
        try:
            subprocess.run(
                [compiler, *flags, str(src), "-o", str(tmp)], check=True, capture_output=True
            )
        except (OSError, subprocess.CalledProcessError):  # e.g. a compiler without OpenMP
            return None
        tmp.replace(lib)  # atomic: a concurrent run never loads a half-written file
    handle = ctypes.CDLL(str(lib))
    for function, _ in LOOP_UNITS.values():
        getattr(handle, function).argtypes = [ctypes.c_long, ctypes.c_int]
        getattr(handle, function).restype = ctypes.c_double
    return handle


def loop_units() -> list[str]:
    """The loop units this CPU (under the ISA cap) can run, narrowest first."""
    flags = cpu_flags() or frozenset()
    return [unit for unit, (_, needs) in LOOP_UNITS.items() if needs <= flags]


def loop_peak_gflops(
    unit: str, threads: int, iters: int = 50_000_000, repeats: int = 3
) -> float | None:
    """Best of ``repeats`` runs of ``unit``'s loop on ``threads`` threads, in GFLOP/s; ``None``
    where the CPU lacks the unit or the loop does not build."""
    if unit not in loop_units():
        return None
    lib = _library()
    if lib is None:
        return None
    function = getattr(lib, LOOP_UNITS[unit][0])
    iters = max(iters // LOOP_ITERS_DIVISOR.get(unit, 1), 1)
    if function(max(iters // 10, 1), threads) < 0:  # warm-up: clocks, power, OpenMP threads
        return None  # the OS refused the unit (AMX tiles without the kernel's permission)
    return max(function(iters, threads) for _ in range(repeats))


def fma_peak_gflops(threads: int, iters: int = 50_000_000, repeats: int = 3) -> float | None:
    """The widest float32 FMA unit's peak (``avx512-fma`` where present, else ``avx2-fma``)."""
    unit = widest_fma_unit()
    return None if unit is None else loop_peak_gflops(unit, threads, iters, repeats)


def widest_fma_unit() -> str | None:
    units = [u for u in loop_units() if u.endswith("-fma")]
    return units[-1] if units else None
