"""Attention benchmark: Triton kernels vs the torch backend vs the memory-bandwidth bound.

On a GPU it times ``attend`` (one layer) for decode batches (``q_len = 1``) and prefill chunks
over realistic batch sizes and context lengths, and reports, per shape, the time of each backend,
the bytes the attention must read (keys and values of every context plus the queries), the
bandwidth that implies and the time a pure copy of those bytes would take at the measured
device-to-device bandwidth (the bound a memory-bound decode can approach). It also checks that
both backends agree.

    python -m kernels.bench                      # GPU: the default sweep
    python -m kernels.bench --interpret          # CPU: tiny shapes through the interpreter
    python -m kernels.bench --out results.md     # also write the table to a file

Timing on CPU means nothing (the interpreter is ~100x slower than torch); ``--interpret`` only
shows the script runs end to end. Without CUDA and without ``--interpret`` it says so and exits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(slots=True)
class Shape:
    """One benchmark point: ``batch`` sequences of ``context`` tokens, ``q_len`` of them new."""

    mode: str  # "decode" or "prefill"
    batch: int
    context: int
    q_len: int

    @property
    def kv_tokens(self) -> int:
        return self.batch * self.context


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-heads", type=int, default=9, help="query heads (default: SmolLM2's 9)")
    p.add_argument("--num-kv-heads", type=int, default=3, help="KV heads (default 3)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (default 16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="default float16")
    p.add_argument(
        "--decode-batches",
        type=_ints,
        default=[1, 8, 32, 64, 256],
        help="decode batch sizes (default 1,8,32,64,256)",
    )
    p.add_argument(
        "--prefill-batches",
        type=_ints,
        default=[1, 4, 16],
        help="prefill batch sizes (default 1,4,16)",
    )
    p.add_argument(
        "--contexts",
        type=_ints,
        default=[512, 2048, 8192, 32768],
        help="context lengths (default 512,2048,8192,32768)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=512,
        help="new tokens per prefill sequence, after a cached prefix (default 512)",
    )
    p.add_argument(
        "--max-kv-tokens",
        type=int,
        default=4_200_000,
        help="skip shapes whose batch*context exceeds this (default 4,200,000: up to 128 x 32k)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per point (default 3)")
    p.add_argument("--iters", type=int, default=10, help="timed runs per point (default 10)")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="run on CPU under TRITON_INTERPRET=1 with tiny shapes (smoke run)",
    )
    p.add_argument("--out", default=None, help="also write the results table to this file")
    return p.parse_args(argv)


def build_case(shape: Shape, args: argparse.Namespace, device: torch.device):
    """Query, paged caches (shuffled blocks) and metadata for one shape."""
    from kernels.interface import AttentionMetadata

    dtype = DTYPES[args.dtype]
    bs, kvh, d = args.block_size, args.num_kv_heads, args.head_dim
    blocks_per_seq = -(-shape.context // bs)
    num_blocks = shape.batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = perm.view(shape.batch, blocks_per_seq)
    k_cache = torch.randn(num_blocks, bs, kvh, d, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kvh, d, device=device, dtype=dtype, generator=gen)
    tokens = shape.batch * shape.q_len
    query = torch.randn(tokens, args.num_heads, d, device=device, dtype=dtype, generator=gen)
    pos = torch.arange(shape.context - shape.q_len, shape.context, device=device)
    slots = (tables[:, pos // bs].long() * bs + pos % bs).reshape(-1)
    q_lens = [shape.q_len] * shape.batch
    seq_lens = [shape.context] * shape.batch
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, tokens + 1, shape.q_len, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=shape.q_len,
        max_seq_len=shape.context,
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    return query, k_cache, v_cache, meta


def time_fn(fn: Callable[[], torch.Tensor], warmup: int, iters: int, device: torch.device) -> float:
    """Median seconds per call (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (reads + writes)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), 3, 10, device)
    return 2 * (1 << 30) / seconds


def bytes_read(shape: Shape, args: argparse.Namespace) -> int:
    """Keys and values of every context position, plus the queries, at the cache dtype."""
    elem = torch.finfo(DTYPES[args.dtype]).bits // 8
    kv = 2 * shape.kv_tokens * args.num_kv_heads * args.head_dim * elem
    q = shape.batch * shape.q_len * args.num_heads * args.head_dim * elem
    return kv + q


def flops(shape: Shape, args: argparse.Namespace) -> float:
    """Matmul FLOPs: each new token attends to its cached prefix plus earlier new tokens."""
    cached = shape.context - shape.q_len
    pairs = shape.q_len * cached + shape.q_len * (shape.q_len + 1) / 2
    return 4.0 * shape.batch * pairs * args.num_heads * args.head_dim


def run_point(shape: Shape, args, device, backends, bandwidth: float) -> dict[str, str]:
    query, k_cache, v_cache, meta = build_case(shape, args, device)
    scale = args.head_dim**-0.5
    row = {
        "mode": shape.mode,
        "batch": str(shape.batch),
        "context": str(shape.context),
        "q_len": str(shape.q_len),
    }
    outs = {}
    for name, backend in backends.items():
        backend.prepare(meta, args.block_size)
        try:
            seconds = time_fn(
                lambda b=backend: b.attend(query, k_cache, v_cache, meta, scale),
                args.warmup,
                args.iters,
                device,
            )
            outs[name] = backend.attend(query, k_cache, v_cache, meta, scale)
            row[f"{name}_us"] = f"{seconds * 1e6:.1f}"
            if name == "triton":
                row["triton_GBps"] = f"{bytes_read(shape, args) / seconds / 1e9:.0f}"
                row["triton_TFLOPs"] = f"{flops(shape, args) / seconds / 1e12:.2f}"
        except torch.cuda.OutOfMemoryError:
            row[f"{name}_us"] = "OOM"
            torch.cuda.empty_cache()
    nbytes = bytes_read(shape, args)
    row["MB_read"] = f"{nbytes / 1e6:.1f}"
    # A memory-bound kernel cannot beat reading its bytes once at copy speed (copy bandwidth
    # counts reads + writes, so a read-only stream gets at most that much).
    bound = nbytes / bandwidth if bandwidth == bandwidth else float("nan")
    row["bound_us"] = f"{bound * 1e6:.1f}"
    if "triton_us" in row and row["triton_us"] != "OOM" and bound == bound:
        row["triton_vs_bound"] = f"{bound / (float(row['triton_us']) / 1e6):.2f}"
    if row.get("torch_us", "OOM") != "OOM" and row.get("triton_us", "OOM") != "OOM":
        row["speedup_vs_torch"] = f"{float(row['torch_us']) / float(row['triton_us']):.2f}"
    if len(outs) == 2:
        diff = (outs["triton"].float() - outs["torch"].float()).abs().max().item()
        row["max_abs_diff"] = f"{diff:.2e}"
    return row


COLUMNS = [
    "mode",
    "batch",
    "context",
    "q_len",
    "MB_read",
    "torch_us",
    "triton_us",
    "bound_us",
    "triton_vs_bound",
    "speedup_vs_torch",
    "triton_GBps",
    "triton_TFLOPs",
    "max_abs_diff",
]


def format_table(rows: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(row.get(c, "-") for c in COLUMNS) + " |")
    return "\n".join(lines)


def shapes(args: argparse.Namespace) -> list[Shape]:
    out = [Shape("decode", b, c, 1) for b in args.decode_batches for c in args.contexts]
    out += [
        Shape("prefill", b, c, min(args.chunk, c))
        for b in args.prefill_batches
        for c in args.contexts
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        # Tiny shapes: the interpreter runs kernels in numpy, one program at a time.
        args.decode_batches, args.prefill_batches = [1, 4], [1]
        args.contexts, args.chunk = [64, 200], 32
        args.warmup, args.iters = 0, 1
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print(
            "kernels.bench: timing needs a CUDA GPU (none found). For a CPU smoke run of the "
            "kernels under the Triton interpreter use: python -m kernels.bench --interpret"
        )
        return 0

    from kernels.torch_ref import TorchAttentionBackend
    from kernels.triton_backend import TritonAttentionBackend

    backends = {
        "torch": TorchAttentionBackend(device=device.type),
        "triton": TritonAttentionBackend(),
    }
    bandwidth = copy_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    header = (
        f"# attention benchmark on {name}\n"
        f"heads {args.num_heads}/{args.num_kv_heads} (q/kv), head_dim {args.head_dim}, "
        f"block_size {args.block_size}, {args.dtype}; measured copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s; times are one layer's attend(), median of {args.iters}."
    )
    if device.type != "cuda":
        header += "\nCPU interpreter run: the times are NOT performance numbers, only a smoke run."
    print(header, flush=True)
    rows = []
    for shape in shapes(args):
        if shape.kv_tokens > args.max_kv_tokens:
            print(f"skip {shape}: batch*context over --max-kv-tokens", flush=True)
            continue
        row = run_point(shape, args, device, backends, bandwidth)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last point's caches are garbage now
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    table = format_table(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
