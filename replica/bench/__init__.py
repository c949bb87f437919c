"""Offline benchmarks of the replica engine, one per module, each against a baseline measured
in the same run: ``prefixmesh bench <name> --help``.

``throughput``  64 x 200-token prompts, 128 output tokens: vs Hugging Face (and vLLM), the
                matmul floor, and one decode step broken into its parts
``varied``      varied output lengths under max_num_seqs, vs vLLM with the same cap
``profile``     a decode step's parts against their floors, and torch.profiler's table
``prefix``      prefix-cache hits: cached tokens, and a hit's prefill time vs cold
``chunked``     chunked prefill: streams' worst gap when a long prompt arrives
``memory``      paged KV memory: slots allocated vs used per running request
``startup``     a fresh process's import to first token
``peak``        the CPU's arithmetic peak per unit vs the engine's GEMM
``attention``   paged decode attention: the C++ kernel vs torch vs one read of the KV
``prefill``     prefill with its attention in the C++ kernel vs torch's SDPA, alternating
``fetch``       two replicas: a prompt's KV fetched from the peer vs prefilled, TTFT and MB/s
``gemm``        bfloat16 linears: oneDNN vs the pair GEMM (AVX-512 BF16), and the engine both ways
``gpu``         the engine on a CUDA GPU: both attention backends' parity with HF, and tok/s

Every command prints what it measured and how. This machine is noisy: compare ratios measured
in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kernels.cpu_flags import cap_torch
from replica.bench.throughput import matmul_floor
from replica.bench.timing import random_prompts, seconds_per_call

__all__ = ["main", "matmul_floor", "random_prompts", "seconds_per_call"]

BENCHMARKS = (
    "throughput", "varied", "profile", "prefix", "chunked", "memory", "startup", "peak",
    "attention", "prefill", "fetch", "gemm", "gpu",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="smollm2")
    common.add_argument(
        "--dtype",
        default="auto",
        help="auto = bfloat16 where the CPU has native bf16, else float32 (default: auto)",
    )
    common.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    common.add_argument(
        "--batch-invariant",
        action="store_true",
        help="run the engine in batch-invariant mode (EngineConfig.batch_invariant)",
    )
    common.add_argument("--json", default=None, help="also write the results to this file")
    parser = argparse.ArgumentParser(
        prog="prefixmesh bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        module = importlib.import_module(f"replica.bench.{name}")
        sub = commands.add_parser(
            name,
            parents=[common],
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    cap_torch()  # under PREFIXMESH_CPU_ISA, torch's GEMMs follow the cap too
    args = build_parser().parse_args(argv)
    result = args.run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
