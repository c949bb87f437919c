"""Generate ``loadtest/data/sample_trace.jsonl``, a small Mooncake-format trace.

The real Mooncake traces are not shipped with the repository, so this script builds one with the
same structure from a fixed seed:

- rows ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``, sorted by
  time, one hash id per 512-token block of the prompt, the last block usually partial;
- hash ids are integers numbered in order of first appearance, and equal ids mean equal blocks,
  so the rows form a prefix tree;
- a few shared system prompts (2 to 12 blocks) with Zipf popularity are the roots; sessions start
  from one of them as a Poisson process and run several turns, each turn's prompt being the
  previous turn's full blocks plus the previous answer and the new question (new ids), separated
  by exponential think times;
- output lengths are log-normal (median about 150 tokens), like chat answers.

    python -m loadtest.make_sample_trace --out loadtest/data/sample_trace.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 512


@dataclass(frozen=True, slots=True)
class TraceShape:
    num_requests: int = 300
    num_system_prompts: int = 6
    zipf: float = 1.1
    session_rate: float = 1.5  # sessions started per second
    mean_turns: float = 3.0
    think_time_s: float = 12.0
    seed: int = 7


def generate(shape: TraceShape) -> list[dict]:
    rng = np.random.default_rng(shape.seed)
    next_id = itertools.count()
    roots = [
        [next(next_id) for _ in range(int(rng.integers(2, 13)))]
        for _ in range(shape.num_system_prompts)
    ]
    weights = 1.0 / np.arange(1, len(roots) + 1) ** shape.zipf
    weights /= weights.sum()
    rows: list[dict] = []
    t = 0.0
    while len(rows) < shape.num_requests:
        t += rng.exponential(1.0 / shape.session_rate)
        history = list(roots[rng.choice(len(roots), p=weights)])  # full blocks so far
        turn_time = t
        for _turn in range(1 + rng.poisson(shape.mean_turns - 1)):
            new_blocks = 1 + int(rng.poisson(1.5))  # question (+ previous answer), last partial
            hash_ids = history + [next(next_id) for _ in range(new_blocks)]
            partial = int(rng.integers(1, BLOCK + 1))
            rows.append(
                {
                    "timestamp": int(turn_time * 1000),
                    "input_length": (len(hash_ids) - 1) * BLOCK + partial,
                    "output_length": int(np.clip(rng.lognormal(np.log(150), 0.8), 1, 2048)),
                    "hash_ids": hash_ids,
                }
            )
            # The next turn reuses every full block; the partial one is completed by the answer
            # and so becomes a different block with a fresh id.
            history = hash_ids[:-1] + [next(next_id)]
            turn_time += rng.exponential(shape.think_time_s)
    rows.sort(key=lambda r: r["timestamp"])
    rows = rows[: shape.num_requests]
    t0 = rows[0]["timestamp"]
    for r in rows:
        r["timestamp"] -= t0
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "data" / "sample_trace.jsonl"
    )
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    rows = generate(TraceShape(num_requests=args.num_requests, seed=args.seed))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    span = rows[-1]["timestamp"] / 1000
    print(f"wrote {len(rows)} requests over {span:.0f} s to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
