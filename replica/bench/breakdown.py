"""One decode step, part by part, measured in place, next to each part's floor.

The engine runs real decode steps while thin wrappers time the model's matmuls (the layers' and
the LM head's), its attention calls, its whole forward and the sampler; what is left of the
forward is the other tensor ops (norms, RoPE, activations, residual adds, KV writes), and what
is left of the step is the host side (scheduling, batch building, detokenization, stop checks).
A wrapper adds about a microsecond a call, on ~150 calls a step.

The floors, measured in the same process: the matmuls alone at the step's shapes with the same
packed weights (best of three, as ``matmul_floor``), and one read of every key and value the
step attends to, through the same block tables (``read_kv_once`` of kernels/cpu_ops.py): once
for all layers back to back, and once in place, each layer's read just before its attention
call, where the layer's matmuls have just streamed its weights through the caches and the TLB.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from replica.bench.timing import seconds_per_call
from replica.engine_request import EngineRequest

PARTS = ("gemm", "attention", "other", "logits", "sampling", "host")
LABELS = {
    "gemm": "GEMMs (every layer's qkv, o, gate_up, down)",
    "attention": "attention (paged decode)",
    "other": "other tensor ops (norms, RoPE, SiLU, residuals, KV writes)",
    "logits": "logits (LM head on the sampled rows)",
    "sampling": "sampling",
    "host": "host (schedule, batch building, detokenize, stop checks)",
}


def layers_floor_s(model, rows: int) -> float:
    """Best-of-three seconds of every layer's matmuls (qkv, o, gate_up, down) at ``rows`` rows."""
    from kernels.cpu_linear import linear

    c = model.config
    x, attn, act = (
        _rows(model, rows, w) for w in (c.hidden_size, model.q_size, c.intermediate_size)
    )

    def layers() -> None:
        for layer in model.layers:
            linear(x, layer["qkv"], layer["qkv_bias"])
            linear(attn, layer["o"])
            linear(x, layer["gate_up"])
            linear(act, layer["down"])

    with torch.inference_mode():
        return seconds_per_call(layers, 3, best=True)


def head_floor_s(model, rows: int) -> float:
    """Best-of-three seconds of the LM head at ``rows`` rows."""
    from kernels.cpu_linear import linear

    x = _rows(model, rows, model.config.hidden_size)
    with torch.inference_mode():
        return seconds_per_call(lambda: linear(x, model.lm_head), 3, best=True)


def _rows(model, rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width).to(model.dtype)


def attention_floor_s(engine) -> float | None:
    """Seconds one read of every running sequence's keys and values takes, over all layers."""
    from kernels import cpu_ops

    kernels = cpu_ops.load()
    running = engine.scheduler.running
    if kernels is None or not running:
        return None
    width = max(len(s.block_table) for s in running)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in running])
    lens = torch.tensor([s.num_tokens for s in running], dtype=torch.int32)
    tables = tables.int()
    caches = engine.runner.kv_caches

    def read_all() -> None:
        for k_cache, v_cache in caches:
            kernels.read_kv_once(k_cache, v_cache, tables, lens)

    return seconds_per_call(read_all, 3, best=True)


def attention_floor_in_place_s(engine, steps: int) -> float | None:
    """Seconds a step's one read of its keys and values takes where the step reads them.

    ``attention_floor_s`` reads every layer's caches back to back. In a step each layer's
    attention comes after its matmuls, which stream the layer's weights through the caches and
    the TLB. Here ``steps`` more decode steps run with each layer's caches read once
    (``read_kv_once``, timed) just before its attention (untimed; its output is unchanged), so
    the read finds the caches as the kernel does. Mean seconds per step; None without the
    extension."""
    from kernels import cpu_ops

    kernels = cpu_ops.load()
    if kernels is None or not engine.scheduler.running:
        return None
    attention = engine.runner.model.attention
    real_attend = attention.attend
    total = 0.0

    def attend(query, k_cache, v_cache, meta, scale, out=None):
        nonlocal total
        start = time.perf_counter()
        kernels.read_kv_once(k_cache, v_cache, meta.block_tables, meta.seq_lens)
        total += time.perf_counter() - start
        return real_attend(query, k_cache, v_cache, meta, scale, out=out)

    attention.attend = attend
    try:
        for _ in range(steps):
            engine.step()
    finally:
        del attention.attend
    return total / steps


@contextmanager
def _timed_parts(engine, totals: dict[str, float]):
    """Wrap the model's matmuls, attention and forward, and the sampler, adding to ``totals``."""
    model = engine.runner.model
    real_linear = model.linear  # the model's matmul (batch-invariant or not)
    real_attend = model.attention.attend
    real_forward = model.forward
    real_sample = engine.sampler.sample
    clock = time.perf_counter

    def linear(x, weight, bias=None, out=None):
        start = clock()
        result = real_linear(x, weight, bias, out=out)
        totals["logits" if weight is model.lm_head else "gemm"] += clock() - start
        return result

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = clock()
            out = fn(*args, **kwargs)
            totals[name] += clock() - start
            return out

        return wrapper

    model.linear = linear
    model.attention.attend = timed("attention", real_attend)
    model.forward = timed("forward", real_forward)
    engine.sampler.sample = timed("sampling", real_sample)
    try:
        yield
    finally:
        model.linear = real_linear
        del model.attention.attend, model.forward, engine.sampler.sample


def engine_steps(steps: int) -> int:
    """Engine steps ``measure_decode_step(engine, steps)`` runs: the timed ones, then as many
    for the attention floor in place. Its sequences need that many tokens left."""
    return 2 * steps


def measure_decode_step(engine, steps: int) -> dict:
    """Time ``steps`` engine steps part by part, then the attention floor in place over as many
    more; the engine must be decoding all its sequences (no prefill left) and each needs
    ``engine_steps(steps)`` tokens left. Returns milliseconds per step for each part and
    floor."""
    num_seqs = len(engine.scheduler.running)
    model = engine.runner.model
    gemm_floor, head_floor = layers_floor_s(model, num_seqs), head_floor_s(model, num_seqs)
    attention_floor = attention_floor_s(engine)
    totals: dict[str, float] = defaultdict(float)
    with _timed_parts(engine, totals):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = time.perf_counter() - start
    ms = {name: 1000 * value / steps for name, value in totals.items()}
    in_place = attention_floor_in_place_s(engine, steps)
    result = {
        "num_seqs": num_seqs,
        "steps": steps,
        "step_ms": 1000 * step_s / steps,
        "gemm_ms": ms.get("gemm", 0.0),
        "attention_ms": ms.get("attention", 0.0),
        "other_ms": ms.get("forward", 0.0)
        - ms.get("gemm", 0.0)
        - ms.get("attention", 0.0)
        - ms.get("logits", 0.0),
        "logits_ms": ms.get("logits", 0.0),
        "sampling_ms": ms.get("sampling", 0.0),
        "gemm_floor_ms": 1000 * gemm_floor,
        "logits_floor_ms": 1000 * head_floor,
        "attention_floor_ms": None if attention_floor is None else 1000 * attention_floor,
        "attention_floor_in_place_ms": None if in_place is None else 1000 * in_place,
    }
    result["host_ms"] = result["step_ms"] - ms.get("forward", 0.0) - result["sampling_ms"]
    # The LM head is a GEMM too: what is left is the goal of the engine-speed work (<= 10 ms).
    result["outside_gemm_and_attention_ms"] = (
        result["step_ms"] - result["gemm_ms"] - result["logits_ms"] - result["attention_ms"]
    )
    return result


def start_decoding(engine, prompts: list[list[int]], max_tokens: int) -> None:
    """Queue ``prompts`` and step until every one is past its prefill (pure decode from here)."""
    from replica.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add(EngineRequest(f"breakdown-{i}-{time.monotonic_ns()}", prompt, params))
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    engine.step()  # the first all-decode step warms this batch shape


def print_breakdown(result: dict) -> None:
    print(
        f"one decode step of {result['num_seqs']} sequences, mean of {result['steps']} steps: "
        f"{result['step_ms']:.1f} ms"
    )
    floors = {
        "gemm": result["gemm_floor_ms"],
        "attention": result["attention_floor_ms"],
        "logits": result["logits_floor_ms"],
    }
    print(f"  {'part':62s} {'ms/step':>8s} {'floor':>8s} {'x floor':>8s}")
    for part in PARTS:
        value, floor = result[f"{part}_ms"], floors.get(part)
        shown = f"{floor:8.1f} {value / floor:7.2f}x" if floor else f"{'-':>8s} {'-':>8s}"
        print(f"  {LABELS[part]:62s} {value:8.1f} {shown}")
    in_place = result.get("attention_floor_in_place_ms")
    if in_place:  # the same read where the kernel does it (attention_floor_in_place_s)
        label = "  attention against its floor in place (read before each call)"
        print(f"  {label:62s} {'':8s} {in_place:8.1f} {result['attention_ms'] / in_place:7.2f}x")
    print(
        "  everything outside GEMMs (LM head included) and attention: "
        f"{result['outside_gemm_and_attention_ms']:.1f} ms a step"
    )
