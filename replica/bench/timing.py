"""What every engine benchmark shares: one timing loop, the workload's prompts, the engine."""

from __future__ import annotations

import random
import time
from collections.abc import Callable


def seconds_per_call(fn: Callable[[], object], calls: int, warmup: int = 1, best: bool = False):
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


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def make_llm(args, **overrides):
    """The engine under test, with the command line's model, dtype and threads."""
    from replica import LLM

    options = dict(dtype=args.dtype, num_threads=args.threads, batch_invariant=args.batch_invariant)
    options.update(overrides)
    return LLM(args.model, **options)


def set_threads(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.get_num_threads()
