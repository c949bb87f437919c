"""``prefixmesh bench profile``: where a decode step's time goes.

Puts 64 sequences (``--num-prompts``) into steady decode, prints the step's part-by-part
breakdown against its floors (replica/bench/breakdown.py), then records a few more steps with
``torch.profiler`` and prints its table of the most expensive operators (the C++ kernels of
kernels/cpu_ops.py show up inside the parts they belong to). With ``--trace F`` it also writes
a Chrome trace (chrome://tracing, Perfetto). For a Python-level flame graph, run this command
under py-spy: ``py-spy record -o step.svg -- prefixmesh bench profile``.
"""

from __future__ import annotations

from replica.bench.breakdown import measure_decode_step, print_breakdown, start_decoding
from replica.bench.timing import make_llm, random_prompts

HELP = "profile a decode step: its parts against their floors, and torch.profiler's table"


def add_arguments(parser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed part by part")
    parser.add_argument("--profiled-steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=25, help="operators in the table")
    parser.add_argument("--trace", default=None, help="write a Chrome trace to this file")


def run(args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(args, max_num_seqs=max(256, args.num_prompts))
    engine = llm.engine
    prompts = random_prompts(args.num_prompts, args.input_len, engine.model_config.vocab_size)
    start_decoding(engine, prompts, max_tokens=args.steps + args.profiled_steps + 8)
    result = measure_decode_step(engine, args.steps)
    print_breakdown(result)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profiled_steps):
            engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(f"torch.profiler, {args.profiled_steps} decode steps (profiling adds overhead):")
    print(table)
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"Chrome trace written to {args.trace}")
    engine.abort_all()
    return {"breakdown": result}
