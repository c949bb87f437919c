"""``prefixmesh bench gemm``: the linear layers on oneDNN against our own GEMM, at SmolLM2's
shapes, alternating in one process: in bfloat16 the pair GEMM (kernels/csrc/pair_gemm.cpp), in
float32 (``--dtype float32``) the panel GEMM (kernels/csrc/panel_gemm.cpp).

Each round times every shape (qkv, o, gate_up, down, the LM head) at each row count, with
``--layers`` distinct copies of each layer's weight taken in turn, so that the weights come from
memory as they do in the engine (one copy would sit in the cache). It prints the best round's
milliseconds for a whole model's worth of each (``--layers`` layers and one LM head), GB/s of
weights and GFLOP/s. With ``--engine-rounds N`` it also runs the engine end to end, both ways,
on the throughput workload (64 x 200 tokens, 128 out) and the varied one (``bench varied``),
alternating N rounds. Where the CPU has no ``vdpbf16ps`` the pair GEMM's plain C++ emulation is
timed instead, and the output says so.
"""

from __future__ import annotations

import os
import time

import torch

from replica.bench.peak import SMOLLM2_LINEARS
from replica.bench.timing import random_prompts, set_threads

HELP = "linears: oneDNN vs our GEMM (bf16 pairs, f32 panels), and the engine both ways"


def add_arguments(parser) -> None:
    parser.add_argument("--rows", default="1,4,16,64,256,1024", help="row counts, comma-separated")
    parser.add_argument("--layers", type=int, default=30, help="weight copies per layer shape")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (best kept)")
    parser.add_argument(
        "--engine-rounds", type=int, default=0, help="engine A/B rounds (0: GEMMs only)"
    )


def _weights(mode: str, layers: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, list]:
    """Each SmolLM2 shape's weights (``layers`` copies; one LM head) packed for ``mode``:
    ``onednn``, the pair GEMM's ``pairs`` / ``emulated`` (bfloat16) or ``panels`` (float32)."""
    from kernels import cpu_linear

    def pack(weight: torch.Tensor):
        if mode == "onednn":
            return cpu_linear.pack_onednn(weight)
        if mode == "panels":
            return cpu_linear.pack_panels(weight, mode)
        return cpu_linear.pack_pairs(weight, mode)

    packed = {}
    for name, (n, k) in SMOLLM2_LINEARS.items():
        copies = 1 if name == "lm_head" else layers
        packed[name] = [
            pack((torch.randn(n, k, generator=gen) * 0.05).to(dtype)) for _ in range(copies)
        ]
    return packed


def _time_model(weights: dict[str, list], rows: int, dtype: torch.dtype) -> dict[str, float]:
    from kernels import cpu_linear

    seconds = {}
    with torch.inference_mode():
        for name, ws in weights.items():
            x = torch.randn(rows, SMOLLM2_LINEARS[name][1]).to(dtype)
            start = time.perf_counter()
            for w in ws:
                cpu_linear.linear(x, w)
            seconds[name] = time.perf_counter() - start
    return seconds


def run(args) -> dict:
    from kernels import cpu_flags, cpu_ops

    threads = set_threads(args)
    ops = cpu_ops.load()
    if ops is None:
        print("the C++ kernels are unavailable here: nothing to compare")
        return {"pairs": None}
    from replica.engine import default_dtype

    if args.dtype == "auto":  # the engine's own choice here
        args.dtype = default_dtype("cpu")
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    if dtype == torch.float32:
        own_mode, own_name = "panels", "panels"
        own_note = f"panel GEMM, build {ops.isa()}"
    else:
        own_mode = "pairs" if ops.pairs_hardware() else "emulated"
        own_name = "pairs"
        own_note = "pair GEMM: " + (
            "vdpbf16ps" if own_mode == "pairs" else "no vdpbf16ps here, timing its emulation"
        )
    flags = cpu_flags.cpu_flags() or frozenset()
    shown = sorted(f for f in flags if f.startswith(("avx2", "fma", "avx512", "amx")))
    print(f"CPU flags: {' '.join(shown)}; {threads} threads; {own_note}")
    gen = torch.Generator().manual_seed(0)
    modes = {
        "onednn": _weights("onednn", args.layers, gen, dtype),
        own_name: _weights(own_mode, args.layers, gen, dtype),
    }
    row_counts = [int(r) for r in args.rows.split(",")]
    best: dict[tuple[str, int], dict[str, float]] = {}
    for _ in range(args.rounds):
        for rows in row_counts:
            for mode, weights in modes.items():
                got = _time_model(weights, rows, dtype)
                key = (mode, rows)
                best[key] = {n: min(s, best.get(key, {}).get(n, s)) for n, s in got.items()}
    result = {
        "threads": threads,
        "dtype": args.dtype,
        "own_path": own_mode,
        "layers": args.layers,
        "gemm": [],
    }
    print(
        f"best of {args.rounds} rounds, {args.layers} layers' weights + one LM head, {args.dtype}:"
    )
    print(f"  {'rows':>5}  {'oneDNN ms':>9}  {'GB/s':>5}  {'GFLOP/s':>7}  {own_name + ' ms':>9}  "
          f"{'GB/s':>5}  {'GFLOP/s':>7}  {'speed-up':>8}")  # fmt: skip
    for rows in row_counts:
        line = {"rows": rows}
        for mode in modes:
            secs = sum(best[(mode, rows)].values())
            elements = sum(
                n * k * (1 if name == "lm_head" else args.layers)
                for name, (n, k) in SMOLLM2_LINEARS.items()
            )
            line[mode] = {
                "ms": 1000 * secs,
                "gb_s": dtype.itemsize * elements / secs / 1e9,
                "gflops": 2 * rows * elements / secs / 1e9,
            }
        line["speedup"] = line["onednn"]["ms"] / line[own_name]["ms"]
        result["gemm"].append(line)
        a, b = line["onednn"], line[own_name]
        print(f"  {rows:>5}  {a['ms']:>9.2f}  {a['gb_s']:>5.1f}  {a['gflops']:>7.0f}  "
              f"{b['ms']:>9.2f}  {b['gb_s']:>5.1f}  {b['gflops']:>7.0f}  {line['speedup']:>7.2f}x")  # fmt: skip
    if args.engine_rounds:
        result["engine"] = _engines(args, own_mode, args.dtype)
    return result


def _engines(args, own_mode: str, dtype: str) -> list[dict]:
    """The engine both ways, alternating: the throughput and the varied workloads."""
    from kernels import cpu_linear
    from replica.bench.timing import make_llm
    from replica.bench.varied import output_lengths
    from replica.sampling_params import SamplingParams

    env = cpu_linear.F32_GEMM_ENV if dtype == "float32" else cpu_linear.GEMM_ENV
    llms = {}
    for mode in ("onednn", own_mode):
        os.environ[env] = mode
        llms[mode] = make_llm(args, dtype=dtype, max_num_seqs=256)
    del os.environ[env]
    rows = []
    for r in range(args.engine_rounds):
        for mode, llm in llms.items():
            engine = llm.engine
            vocab = engine.model_config.vocab_size
            llm.generate(random_prompts(2, 8, vocab), SamplingParams(temperature=0, max_tokens=2))
            engine.reset_prefix_cache()
            prompts = random_prompts(64, 200, vocab, seed=100 + r)
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
            throughput_s = time.perf_counter() - start
            engine.reset_prefix_cache()
            engine.scheduler.config.max_num_seqs = 16  # the varied workload's cap (bench varied)
            lengths = output_lengths(64, 20, 1000)
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
            start = time.perf_counter()
            llm.generate(random_prompts(64, 200, vocab, seed=5 + r), params)
            varied_s = time.perf_counter() - start
            engine.scheduler.config.max_num_seqs = 256
            engine.reset_prefix_cache()
            row = {
                "round": r,
                "gemm": mode,
                "throughput_tok_s": 64 * 128 / throughput_s,
                "varied_tok_s": sum(lengths) / varied_s,
            }
            rows.append(row)
            print(
                f"engine round {r}, {mode:8s}: throughput workload {row['throughput_tok_s']:.1f} "
                f"tok/s, varied workload {row['varied_tok_s']:.1f} tok/s"
            )
    return rows
