"""``prefixmesh bench profile``: where a decode step's time goes.

Puts 64 sequences (``--num-prompts``) into steady decode, prints the step's part-by-part
breakdown against its floors (replica/bench/breakdown.py), then records a few more steps with
``torch.profiler`` and prints its table of the most expensive operators. Our C++ kernels
(kernels/cpu_ops.py, the packed GEMMs of kernels/cpu_linear.py, the paged attention) are
pybind calls, not torch operators, so the profiler would not see them: while it records, each
runs inside a ``record_function`` range named after it (``cpu_ops.rms_norm``, ``linear``,
``lm_head``, ``attention``), which the table lists like an operator. The engine's own calls
are untouched outside this command. With ``--trace F`` it also writes a Chrome trace
(chrome://tracing, Perfetto). For a Python-level flame graph, run this command under py-spy:
``py-spy record -o step.svg -- prefixmesh bench profile``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from replica.bench.breakdown import (
    engine_steps,
    measure_decode_step,
    print_breakdown,
    start_decoding,
)
from replica.bench.timing import make_llm, random_prompts

HELP = "profile a decode step: its parts against their floors, and torch.profiler's table"


def add_arguments(parser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed part by part")
    parser.add_argument("--profiled-steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=25, help="operators in the table")
    parser.add_argument("--trace", default=None, help="write a Chrome trace to this file")


def _ranged(label: str, fn: Callable) -> Callable:
    from torch.profiler import record_function

    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)

    return call


class _RangedOps:
    """The kernels module with each of its functions inside a profiler range of its name."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._ops, name)
        if callable(value):
            value = _ranged(f"cpu_ops.{name}", value)
            setattr(self, name, value)  # wrapped once
        return value


@contextlib.contextmanager
def kernel_ranges(engine) -> Iterator[None]:
    """Run the model's kernels, matmuls and attention inside profiler ranges."""
    model = engine.runner.model
    real_linear, real_ops = model.linear, model.ops
    ranged_linear = _ranged("linear", real_linear)
    ranged_head = _ranged("lm_head", real_linear)

    def linear(x, weight, bias=None, out=None):
        return (ranged_head if weight is model.lm_head else ranged_linear)(x, weight, bias, out=out)

    model.linear = linear
    model.attention.attend = _ranged("attention", model.attention.attend)
    if real_ops is not None:
        model.ops = _RangedOps(real_ops)
    try:
        yield
    finally:
        model.linear, model.ops = real_linear, real_ops
        del model.attention.attend


def run(args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(args, max_num_seqs=max(256, args.num_prompts))
    engine = llm.engine
    prompts = random_prompts(args.num_prompts, args.input_len, engine.model_config.vocab_size)
    start_decoding(engine, prompts, max_tokens=engine_steps(args.steps) + args.profiled_steps + 8)
    result = measure_decode_step(engine, args.steps)
    print_breakdown(result)
    with kernel_ranges(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
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
