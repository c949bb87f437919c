"""``prefixmesh bench prefill``: the prefill phase with its attention in the C++ kernel
(``paged_prefill``: query tiles over keys staged once, the default) against torch's SDPA per
sequence, alternating in one process
with fresh prompts each time (so no prefix-cache hit), on short prompts and on long ones that
prefill in chunks after a cached prefix. For the short prompts it also times the matmul floor
of the same prefill (``bench throughput``'s, without the decode steps) and prints the kernel's
best round against it: the prefill alone, where ``bench throughput``'s prefill phase also holds
the decode steps of the sequences already prefilled, mixed into the same engine steps."""

from __future__ import annotations

import time

from replica.bench.throughput import matmul_floor
from replica.bench.timing import make_llm, random_prompts
from replica.sampling_params import SamplingParams

HELP = "prefill: attention in the C++ kernel vs torch SDPA per sequence, alternating"


def add_arguments(parser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--long-prompts", type=int, default=3, help="0: skip the long case")
    parser.add_argument("--long-len", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)


def run(args) -> dict:
    llm = make_llm(args)
    attention = llm.engine.runner.attention
    if not getattr(attention, "_use_cpu_kernel", False):
        print("the C++ CPU kernels are not in use here: nothing to compare")
        return {"compared": False}
    vocab = llm.engine.model_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(random_prompts(2, 50, vocab, seed=1), one)  # warm-up
    cases = [("short", args.num_prompts, args.input_len)]
    if args.long_prompts:
        cases.append(("long", args.long_prompts, args.long_len))
    result: dict = {"compared": True, "rounds": args.rounds}
    seed = 100
    for name, count, length in cases:
        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        for _ in range(args.rounds):
            for arm in ("sdpa", "kernel"):
                attention.prefill_in_kernel = arm == "kernel"
                seed += 1
                prompts = random_prompts(count, length, vocab, seed=seed)
                start = time.perf_counter()
                llm.generate(prompts, one)
                times[arm].append(time.perf_counter() - start)
        attention.prefill_in_kernel = True
        result[name] = {"prompts": count, "tokens": length, **times}
        print(
            f"prefill of {count} x {length} tokens, {args.rounds} rounds alternating: SDPA per "
            f"sequence {' / '.join(f'{t:.2f}' for t in times['sdpa'])} s, paged_prefill "
            f"{' / '.join(f'{t:.2f}' for t in times['kernel'])} s "
            f"(best {min(times['sdpa']) / min(times['kernel']):.2f}x faster)"
        )
        if name == "short":
            chunk = llm.engine.config.max_num_batched_tokens
            floor = matmul_floor(llm.engine.runner.model, count * length, chunk, count, 1)
            result[name]["floor_s"] = floor["floor_prefill_s"]
            result[name]["kernel_vs_floor"] = min(times["kernel"]) / floor["floor_prefill_s"]
            print(
                f"  matmul floor of that prefill ({chunk}-token steps, best of 3 each): "
                f"{floor['floor_prefill_s']:.2f} s; paged_prefill's best round took "
                f"{result[name]['kernel_vs_floor']:.2f}x that"
            )
    return result
