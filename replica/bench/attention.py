"""``prefixmesh bench attention``: one layer's paged decode attention on the CPU (SmolLM2's
heads, 64 sequences of ~240 tokens): the C++ kernel against the pure torch path (gather the
blocks, then SDPA), and against its floor, one read of the same keys and values through the
same block tables (``read_kv_once``, the same extension), all in one run."""

from __future__ import annotations

import functools

from replica.bench.timing import seconds_per_call, set_threads

HELP = "paged decode attention: the C++ kernel vs torch vs one read of the KV"


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="sequences")
    parser.add_argument("--context", type=int, default=240, help="mean context length")
    parser.add_argument("--iters", type=int, default=20, help="timed calls")
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers, each with its own caches, attended in turn per call: 1 keeps the KV in "
        "the L3 (a hot read); 30 reads it from memory as the engine's step does",
    )
    parser.add_argument(
        "--blocks",
        choices=("scattered", "contiguous"),
        default="scattered",
        help="where each sequence's blocks lie in the pool: scattered at random (a busy "
        "engine) or one after another (a fresh one, where the hardware prefetcher follows)",
    )
    parser.add_argument(
        "--lengths",
        choices=("even", "aged"),
        default="even",
        help="contexts of the sequences: even (each within 32 tokens of --context) or aged "
        "(falling from 1.75x to 0.25x --context along the batch, oldest request first, as a "
        "server's batch holds them)",
    )
    parser.add_argument(
        "--isa",
        default=None,
        help="kernel build: generic, avx2, avx512, amx (default: this CPU's)",
    )


def decode_batch(
    batch: int, context: int, dtype, seed: int = 0, contiguous: bool = False, aged: bool = False
) -> dict:
    """A decode step's inputs at SmolLM2's heads: ``batch`` sequences of ``context`` +- 32
    tokens (``aged``: from 1.75x down to 0.25x ``context``, the oldest first), their blocks
    scattered over a pool twice the size needed, as in a busy engine (or, ``contiguous``, each
    sequence's blocks one after another)."""
    import torch

    from kernels.interface import AttentionMetadata

    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(seed)
    if aged:
        share = torch.linspace(1.75, 0.25, batch) if batch > 1 else torch.ones(1)
        lens = (share * context).round().long().clamp(min=1)
    else:
        lens = torch.randint(context - 32, context + 33, (batch,), generator=gen)
    blocks_per_seq = (int(lens.max()) + block - 1) // block
    num_blocks = 2 * batch * blocks_per_seq
    order = torch.arange(num_blocks) if contiguous else torch.randperm(num_blocks, generator=gen)
    tables = order[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).int()
    positions = (lens - 1).tolist()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=lens.int(),
        block_tables=tables,
        slot_mapping=torch.tensor(
            [int(tables[i, p // block]) * block + p % block for i, p in enumerate(positions)]
        ),
        max_query_len=1,
        max_seq_len=int(lens.max()),
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=lens.tolist(),
    )
    cache_shape = (num_blocks, block, kv_heads, head_dim)
    return {
        "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block": block,
        "lens": lens, "tables": tables, "meta": meta,
        "k_cache": torch.randn(*cache_shape, generator=gen).to(dtype),
        "v_cache": torch.randn(*cache_shape, generator=gen).to(dtype),
        "query": torch.randn(batch, heads, head_dim, generator=gen).to(dtype),
    }  # fmt: skip


def run(args) -> dict:
    import torch

    from kernels import cpu_ops
    from kernels.interface import kv_huge_pages
    from kernels.torch_ref import TorchAttentionBackend
    from replica.engine import default_dtype

    threads = set_threads(args)
    dtype = getattr(torch, default_dtype("cpu") if args.dtype == "auto" else args.dtype)
    d = decode_batch(
        args.batch, args.context, dtype, contiguous=args.blocks == "contiguous",
        aged=args.lengths == "aged",
    )  # fmt: skip
    lens, tables, meta = d["lens"], d["tables"], d["meta"]
    k_cache = d["k_cache"]
    caches = _layer_caches(d, args.layers)

    def per_layer_ms(fn) -> float:
        return seconds_per_call(fn, args.iters, warmup=3) * 1000 / args.layers

    def every_layer(fn, layout: str):
        return lambda: [fn(k, v) for k, v in caches[layout]][0]

    dtype_name = str(dtype).removeprefix("torch.")
    outputs = {}
    result = {"batch": args.batch, "mean_context": float(lens.float().mean())}
    result.update(dtype=dtype_name, layers=args.layers, blocks=args.blocks, lengths=args.lengths)
    result["huge_pages"] = kv_huge_pages()
    kernels = cpu_ops.load(args.isa)
    result["isa"] = kernels.isa() if kernels is not None else None
    scale = d["head_dim"] ** -0.5
    layout = TorchAttentionBackend(isa=args.isa).key_layout(dtype, d["block"], d["head_dim"])
    result["key_layout"] = layout
    for name, use_kernel, keys in _runs(layout, kernels, d["block"]):
        backend = TorchAttentionBackend(use_cpu_kernel=use_kernel, isa=args.isa)
        if use_kernel is None and not backend._use_cpu_kernel:
            print("the C++ kernel is not available here (no compiler?)")
            break
        backend.prepare(meta, d["block"])
        attend = functools.partial(backend.attend, d["query"], meta=meta, scale=scale)
        attend = every_layer(attend, keys)
        outputs[name] = attend()
        result[f"{name}_ms"] = per_layer_ms(attend)
    if (
        kernels is not None
        and kernels.set_decode_scores("auto") == "amx"
        and dtype == torch.bfloat16
    ):
        # The AMX build scores bfloat16 keys on the tile unit: the same call with FMA scores.
        backend = TorchAttentionBackend(isa=args.isa)
        backend.prepare(meta, d["block"])
        attend = functools.partial(backend.attend, d["query"], meta=meta, scale=scale)
        attend = every_layer(attend, "rows")  # tiles read keys in rows
        try:
            kernels.set_decode_scores("fma")
            result["cpu_kernel_fma_scores_ms"] = per_layer_ms(attend)
        finally:
            kernels.set_decode_scores("auto")
    _compare(outputs, result)
    row_bytes = 2 * d["kv_heads"] * d["head_dim"] * k_cache.element_size()
    result["kv_mb"] = sum(int(n) for n in lens) * row_bytes / 1e6
    if kernels is not None:
        # The floor: every key and value the step attends to, read once, the kernel's way
        # (in the layout the kernel just read).
        int_lens = lens.int()
        read = every_layer(lambda k, v: kernels.read_kv_once(k, v, tables, int_lens), layout)
        result["read_kv_ms"] = per_layer_ms(read)
        result["kernel_vs_floor"] = result["cpu_kernel_ms"] / result["read_kv_ms"]
    _print(args, d, dtype_name, threads, result)
    return result


def _layer_caches(d: dict, layers: int) -> dict:
    """Per layout the kernel reads (kernels.interface.new_kv_cache, on huge pages where the
    engine puts them: ``PREFIXMESH_KV_HUGE_PAGES``), one (keys, values) pair per layer, the same
    keys and values in each; the first layer's holds ``d``'s (its output is the one compared)."""
    import torch

    from kernels.interface import KEY_LAYOUTS

    k_cache, v_cache = d["k_cache"], d["v_cache"]
    rows = [(k_cache, v_cache)] + [
        (torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(layers - 1)
    ]
    return {name: [_in_layout(name, k, v) for k, v in rows] for name in KEY_LAYOUTS}


def _runs(layout: str, kernels, block: int) -> list[tuple[str, bool | None, str]]:
    """(result name, use_cpu_kernel, layout) to time: the kernel on the layout the engine would
    choose here, the torch path, then the kernel on the other layouts it can read."""
    runs = [("cpu_kernel", None, layout), ("torch_sdpa", False, "rows")]
    for other in ("rows", "tokens", "heads"):
        whole = kernels is not None and block % kernels.vector_width() == 0
        if other != layout and (other != "tokens" or whole):
            runs.append((f"cpu_kernel_{other}_keys", None, other))
    return runs


def _compare(outputs: dict, result: dict) -> None:
    """The kernel's outputs (each layout) against the torch path's, and its speed-up."""
    if "cpu_kernel" in outputs and "torch_sdpa" in outputs:
        diffs = [
            float((out.float() - outputs["torch_sdpa"].float()).abs().max())
            for name, out in outputs.items()
            if name != "torch_sdpa"
        ]
        result["max_abs_diff"] = max(diffs)
        result["speedup"] = result["torch_sdpa_ms"] / result["cpu_kernel_ms"]


def _in_layout(layout: str, keys, values):
    """``keys`` and ``values`` (contiguous caches) copied into ``layout``, in memory as the
    engine allocates its pool."""
    from kernels.interface import kv_huge_pages, new_kv_cache

    huge = kv_huge_pages()
    k, v = new_kv_cache(*keys.shape, dtype=keys.dtype, key_layout=layout, huge_pages=huge)
    return k.copy_(keys), v.copy_(values)


def _print(args, d: dict, dtype_name: str, threads: int, result: dict) -> None:
    print(
        f"paged decode attention, one layer, {args.batch} sequences of ~{args.context} tokens "
        f"({d['heads']}/{d['kv_heads']} heads, head_dim {d['head_dim']}, {dtype_name}, "
        f"{threads} threads, kernel build {result['isa']}), mean of {args.iters} calls"
        + (f" over {args.layers} layers' caches in turn, per layer" if args.layers > 1 else "")
        + f", blocks {args.blocks}, lengths {args.lengths}, "
        + ("huge pages" if result["huge_pages"] else "4 KB pages")
        + ":"
    )
    layout = result.get("key_layout")
    labels = {
        "cpu_kernel": f"cpu_kernel ({layout} keys, the engine's choice here)",
        "cpu_kernel_rows_keys": "cpu_kernel (rows keys)",
        "cpu_kernel_tokens_keys": "cpu_kernel (tokens keys)",
        "cpu_kernel_heads_keys": "cpu_kernel (heads: keys head-major too)",
        "cpu_kernel_fma_scores": "cpu_kernel, rows keys scored by FMAs instead of AMX tiles",
        "torch_sdpa": "torch_sdpa",
    }
    for name, label in labels.items():
        if f"{name}_ms" in result:
            print(f"  {label:48s} {result[f'{name}_ms']:7.2f} ms")
    if "read_kv_ms" in result:
        print(
            f"  floor: one read of the {result['kv_mb']:.1f} MB of keys and values (a layer's) "
            f"through the "
            f"block tables: {result['read_kv_ms']:.2f} ms; the kernel takes "
            f"{result['kernel_vs_floor']:.2f}x that"
        )
    if "speedup" in result:
        print(
            f"  C++ kernel / torch path: {result['speedup']:.1f}x faster "
            f"(max abs difference {result['max_abs_diff']:.1e})"
        )
