"""``prefixmesh bench peak``: the CPU's measured arithmetic peak per unit, next to what the
engine's GEMM (kernels/cpu_linear.py) reaches at SmolLM2's linear-layer shapes, per dtype.

float32 GEMMs run on the widest FMA unit (``avx512-fma`` on AVX-512 machines, ``avx2-fma``
elsewhere). bfloat16 GEMMs are timed where the CPU computes bfloat16 natively, and run on AMX
tiles (``amx-bf16``) or, without AMX, on ``vdpbf16ps`` (``avx512-bf16``). Each GEMM is set
against the peak of the unit it runs on; no GEMM can beat it. See kernels/fma_peak.py for how
each unit is measured.
"""

from __future__ import annotations

import functools

from replica.bench.timing import seconds_per_call, set_threads

HELP = "the CPU's arithmetic peak per unit vs the engine's GEMM at the model's shapes"

# SmolLM2-135M's linear layers, (output, input) features: qkv, o, gate_up, down, LM head.
SMOLLM2_LINEARS = {
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
    "lm_head": (49152, 576),
}  # fmt: skip


def add_arguments(parser) -> None:
    parser.add_argument("--iters", type=int, default=20, help="timed calls per GEMM shape")
    parser.add_argument(
        "--peak-iters", type=int, default=50_000_000, help="rounds per thread of each peak loop"
    )


def unit_for(dtype: str, peaks: dict[str, float | None]) -> str | None:
    """The unit a GEMM of ``dtype`` runs on here (of those measured)."""
    order = ["amx-bf16", "avx512-bf16"] if dtype == "bfloat16" else []
    order += ["avx512-fma", "avx2-fma"]  # bfloat16 without native support widens to float32
    return next((unit for unit in order if peaks.get(unit)), None)


def run(args) -> dict:
    import torch

    from kernels.cpu_flags import cpu_isa
    from kernels.cpu_linear import linear, pack
    from kernels.fma_peak import LOOP_UNITS, loop_peak_gflops
    from replica.engine import cpu_has_native_bf16

    threads = set_threads(args)
    peaks: dict[str, float | None] = {
        unit: loop_peak_gflops(unit, threads, iters=args.peak_iters) for unit in LOOP_UNITS
    }
    dtypes = ["float32"] + (["bfloat16"] if cpu_has_native_bf16() else [])
    result: dict = {"threads": threads, "isa": cpu_isa(), "peaks": peaks, "gemm": {}}
    with torch.inference_mode():
        for dtype in dtypes:
            flops = seconds = 0.0
            shapes = result["gemm"][dtype] = {}
            for rows in (64, 1024):
                for name, (n, k) in SMOLLM2_LINEARS.items():
                    if name == "lm_head" and rows > 64:
                        continue  # the LM head only runs on the sampled rows
                    x = torch.randn(rows, k).to(getattr(torch, dtype))
                    w = pack(torch.randn(n, k).to(getattr(torch, dtype)))
                    took = seconds_per_call(functools.partial(linear, x, w), args.iters)
                    shapes[f"{name}_m{rows}"] = 2 * rows * n * k / took / 1e9
                    flops, seconds = flops + 2 * rows * n * k, seconds + took
            unit = unit_for(dtype, peaks)
            summary = {"gflops": flops / seconds / 1e9, "unit": unit}
            if unit:
                summary["peak_gflops"] = peaks[unit]
                summary["share_of_peak"] = summary["gflops"] / peaks[unit]
                summary["best_share_of_peak"] = max(shapes.values()) / peaks[unit]
            result[f"{dtype}_summary"] = summary
    _print(result, dtypes)
    return result


def _print(result: dict, dtypes: list[str]) -> None:
    print(f"on {result['threads']} threads, ISA level {result['isa']}:")
    for unit, gflops in result["peaks"].items():
        shown = f"{gflops:9.1f} GFLOP/s" if gflops else "   not measured here"
        print(f"  peak {unit:12s} {shown}")
    for dtype in dtypes:
        summary = result[f"{dtype}_summary"]
        print(f"{dtype} GEMMs (kernels.cpu_linear) at SmolLM2's shapes:")
        for shape, gflops in result["gemm"][dtype].items():
            print(f"  {shape:12s} {gflops:7.1f} GFLOP/s")
        line = f"  all shapes: {summary['gflops']:.1f} GFLOP/s"
        if summary["unit"]:
            line += (
                f" = {100 * summary['share_of_peak']:.0f}% of the {summary['unit']} peak "
                f"(best shape {100 * summary['best_share_of_peak']:.0f}%)"
            )
        print(line)
