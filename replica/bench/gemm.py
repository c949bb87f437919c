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

In float32 it also times the panel GEMM without asking for each thread's next panels ahead
(``set_panel_ahead(False)``), on the same weights in the same rounds, and prints what asking
ahead saves. ``--ahead-steps N`` measures the same in the engine: ``--ahead-batch`` sequences
(default 64) in steady decode, N pairs of decode steps, one of each pair with it on and one off
(in turn first); it prints both medians and in how many pairs it was faster. Whole steps
alternate because this machine's speed drifts by more than the difference over the seconds a
round of several steps takes.

Our own GEMMs' weights sit on huge pages, as the engine puts them
(``PREFIXMESH_WEIGHT_HUGE_PAGES``, kernels/cpu_linear.py ``on_huge_pages``); the same weights
copied onto torch's allocator (4 KB pages, unless the kernel's THP setting is ``always``) are
timed in the same rounds, and it prints what huge pages save. ``--pages-steps N`` measures
the same in the engine: N pairs of decode steps at each of ``--pages-batches``, the model's
packed weights swapped between the two copies.
"""

from __future__ import annotations

import os
import time
from unittest import mock

import torch

from kernels.interface import WEIGHT_HUGE_PAGES_ENV, weight_huge_pages
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
    parser.add_argument(
        "--ahead-steps", type=int, default=0,
        help="float32: decode-step pairs, panels asked for ahead vs not (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--ahead-batch", type=int, default=64, help="sequences decoding in --ahead-steps"
    )
    parser.add_argument(
        "--pages-steps", type=int, default=0,
        help="decode-step pairs, our GEMMs' weights on huge pages vs 4 KB pages (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--pages-batches", default="1,4,8,64", help="sequences decoding in --pages-steps, each"
    )


def _weights(mode: str, layers: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, list]:
    """Each SmolLM2 shape's weights (``layers`` copies; one LM head) packed for ``mode``:
    ``onednn``, the pair GEMM's ``pairs`` / ``emulated`` (bfloat16) or ``panels`` (float32);
    our own GEMMs' on huge pages where the engine puts them (``PREFIXMESH_WEIGHT_HUGE_PAGES``)."""
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
        if weight_huge_pages():
            cpu_linear.on_huge_pages(packed[name])
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


NO_AHEAD = "panels_not_ahead"  # the panel GEMM with set_panel_ahead(False)
SMALL_PAGES = "own_small_pages"  # our GEMM's weights copied onto torch's allocator


def _on_small_pages(weight):
    """A copy of a weight packed for our own GEMM on torch's allocator (4 KB pages); any
    other weight as it is."""
    from kernels.cpu_linear import PairPacked, PanelPacked

    if isinstance(weight, (PanelPacked, PairPacked)):
        return weight._replace(packed=weight.packed.clone())
    return weight


def _best_times(ops, arms: dict[str, dict], row_counts: list[int], rounds: int, dtype) -> dict:
    """Each arm's best seconds per shape at each row count over ``rounds`` alternating rounds."""
    best: dict[tuple[str, int], dict[str, float]] = {}
    try:
        for _ in range(rounds):
            for rows in row_counts:
                for mode, weights in arms.items():
                    ops.set_panel_ahead(mode != NO_AHEAD)
                    got = _time_model(weights, rows, dtype)
                    key = (mode, rows)
                    best[key] = {n: min(s, best.get(key, {}).get(n, s)) for n, s in got.items()}
    finally:
        ops.set_panel_ahead(True)
    return best


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
    # In float32 the panel GEMM also runs without asking for its next panels ahead, on the same
    # weights: what that saves (kernels/csrc/panel_gemm.cpp).
    arms = {**modes, NO_AHEAD: modes["panels"]} if own_name == "panels" else dict(modes)
    if weight_huge_pages():  # the same weights on 4 KB pages: what huge pages save
        arms[SMALL_PAGES] = {n: list(map(_on_small_pages, ws)) for n, ws in modes[own_name].items()}
    best = _best_times(ops, arms, row_counts, args.rounds, dtype)
    result = {
        "threads": threads,
        "dtype": args.dtype,
        "own_path": own_mode,
        "layers": args.layers,
    }
    print(
        f"best of {args.rounds} rounds, {args.layers} layers' weights + one LM head, {args.dtype}:"
    )
    result["gemm"] = _table(best, arms, own_name, row_counts, args.layers, dtype)
    if args.engine_rounds:
        result["engine"] = _engines(args, own_mode, args.dtype)
    if args.ahead_steps and NO_AHEAD in arms:
        result["ahead_steps"] = _ahead_steps(args, ops)
    if args.pages_steps:
        result["pages_steps"] = _pages_steps(args)
    return result


def _table(best: dict, arms: dict, own_name: str, row_counts: list[int], layers: int, dtype):
    """One line a row count from ``_best_times``: each arm's milliseconds, GB/s and GFLOP/s for
    the whole model, our GEMM's speed-up over oneDNN, and what asking ahead and huge pages
    save; printed, and returned."""
    lines = []
    print(f"  {'rows':>5}  {'oneDNN ms':>9}  {'GB/s':>5}  {'GFLOP/s':>7}  {own_name + ' ms':>9}  "
          f"{'GB/s':>5}  {'GFLOP/s':>7}  {'speed-up':>8}"
          + (f"  {'not ahead ms':>12}  {'ahead saves':>11}" if NO_AHEAD in arms else "")
          + (f"  {'4 KB pages ms':>13}  {'huge saves':>10}" if SMALL_PAGES in arms else ""))  # fmt: skip
    elements = sum(
        n * k * (1 if name == "lm_head" else layers) for name, (n, k) in SMOLLM2_LINEARS.items()
    )
    for rows in row_counts:
        line: dict = {"rows": rows}
        for mode in arms:
            secs = sum(best[(mode, rows)].values())
            line[mode] = {
                "ms": 1000 * secs,
                "gb_s": dtype.itemsize * elements / secs / 1e9,
                "gflops": 2 * rows * elements / secs / 1e9,
            }
        line["speedup"] = line["onednn"]["ms"] / line[own_name]["ms"]
        lines.append(line)
        a, b = line["onednn"], line[own_name]
        text = (f"  {rows:>5}  {a['ms']:>9.2f}  {a['gb_s']:>5.1f}  {a['gflops']:>7.0f}  "
                f"{b['ms']:>9.2f}  {b['gb_s']:>5.1f}  {b['gflops']:>7.0f}  {line['speedup']:>7.2f}x")  # fmt: skip
        if NO_AHEAD in arms:
            line["ahead_speedup"] = line[NO_AHEAD]["ms"] / b["ms"]
            text += f"  {line[NO_AHEAD]['ms']:>12.2f}  {line['ahead_speedup']:>10.2f}x"
        if SMALL_PAGES in arms:
            line["huge_pages_speedup"] = line[SMALL_PAGES]["ms"] / b["ms"]
            text += f"  {line[SMALL_PAGES]['ms']:>13.2f}  {line['huge_pages_speedup']:>9.2f}x"
        print(text)
    return lines


def _step_pairs(engine, batch: int, pairs: int, arms: dict) -> dict[str, list[float]]:
    """Milliseconds of ``pairs`` pairs of single decode steps of ``batch`` sequences: each pair
    runs both ``arms`` (name -> a call that sets the engine up for it), in turn first."""
    from replica.bench.breakdown import start_decoding

    prompts = random_prompts(batch, 200, engine.model_config.vocab_size, seed=7)
    start_decoding(engine, prompts, max_tokens=2 * pairs + 8)
    names = list(arms)
    ms: dict[str, list[float]] = {name: [] for name in names}
    try:
        for pair in range(pairs):
            for name in names if pair % 2 == 0 else names[::-1]:
                arms[name]()
                start = time.perf_counter()
                engine.step()
                ms[name].append(1000 * (time.perf_counter() - start))
    finally:
        engine.abort_all()
    return ms


def _print_pairs(what: str, ms: dict[str, list[float]]) -> None:
    import statistics

    (a, first), (b, second) = ms.items()
    on, off = statistics.median(first), statistics.median(second)
    wins = sum(x < y for x, y in zip(first, second))
    print(
        f"engine, {len(first)} pairs of decode steps ({what}): median {on:.2f} ms {a}, "
        f"{off:.2f} ms {b} ({off / on:.3f}x); faster in {wins} of {len(first)} pairs"
    )


def _ahead_steps(args, ops) -> dict:
    """Decode steps of ``--ahead-batch`` sequences with the panel GEMM asking ahead and not,
    in pairs."""
    from kernels import cpu_linear
    from replica.bench.timing import make_llm

    # The panel GEMM even where float32 runs on oneDNN by default (AVX-512 builds).
    with mock.patch.dict(os.environ, {cpu_linear.F32_GEMM_ENV: "panels"}):
        llm = make_llm(args, dtype="float32", max_num_seqs=256)
    arms = {
        "asking ahead": lambda: ops.set_panel_ahead(True),
        "not": lambda: ops.set_panel_ahead(False),
    }
    try:
        ms = _step_pairs(llm.engine, args.ahead_batch, args.ahead_steps, arms)
    finally:
        ops.set_panel_ahead(True)
    _print_pairs(f"{args.ahead_batch} sequences, float32", ms)
    return {
        "pairs": args.ahead_steps,
        "batch": args.ahead_batch,
        "ahead_ms": ms["asking ahead"],
        "not_ahead_ms": ms["not"],
    }


def _pages_steps(args) -> list[dict]:
    """Decode steps at each of ``--pages-batches`` with the model's packed weights on huge
    pages and on 4 KB pages, in pairs (the engine as it runs here, ``--dtype``)."""
    from replica.bench.timing import make_llm

    with mock.patch.dict(os.environ, {WEIGHT_HUGE_PAGES_ENV: "1"}):
        llm = make_llm(args, max_num_seqs=256)
    model = llm.engine.runner.model
    huge = model.gemm_weights()
    small = [_on_small_pages(weight) for weight in huge]
    if all(a is b for a, b in zip(huge, small)):
        print("engine: no weights of our own GEMMs here (oneDNN's), nothing on huge pages")
        return []
    arms = {
        "on huge pages": lambda: model.set_gemm_weights(huge),
        "on 4 KB pages": lambda: model.set_gemm_weights(small),
    }
    rows = []
    for batch in (int(b) for b in args.pages_batches.split(",")):
        ms = _step_pairs(llm.engine, batch, args.pages_steps, arms)
        _print_pairs(f"{batch} sequences, {model.dtype}".replace("torch.", ""), ms)
        rows.append(
            {"batch": batch, "huge_ms": ms["on huge pages"], "small_ms": ms["on 4 KB pages"]}
        )
    model.set_gemm_weights(huge)
    return rows


def _engines(args, own_mode: str, dtype: str) -> list[dict]:
    """The engine both ways, alternating: the throughput and the varied workloads."""
    from kernels import cpu_linear
    from replica.bench.timing import make_llm
    from replica.bench.varied import output_lengths
    from replica.sampling_params import SamplingParams

    env = cpu_linear.F32_GEMM_ENV if dtype == "float32" else cpu_linear.GEMM_ENV
    llms = {}
    for mode in ("onednn", own_mode):
        with mock.patch.dict(os.environ, {env: mode}):
            llms[mode] = make_llm(args, dtype=dtype, max_num_seqs=256)
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
