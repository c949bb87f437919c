"""``python -m loadtest.eviction_table``: each eviction policy's one-cache hit rate against
Belady's, on windows of a trace (the issue-52 table, docs/notes/2026-12-08-eviction.md).

For each window (``--first`` request indices, ``--limit`` requests each) it runs the capacity
ceiling of ``loadtest/ceilings.py`` (one cache of ``--capacity`` blocks, the whole cluster's
memory) once per replica policy (``prefixmesh/eviction.py``) and once with the offline-optimal
order (``loadtest/belady.py``), and prints the hit rates, Belady's headroom over LRU and each
policy's ratio to LRU. No timing, no randomness beyond the token seed: the ratios are exact.

```bash
python -m loadtest.eviction_table --trace ../shared/data/traces/synthetic_trace.jsonl \
    --first 0,1500,3000 --limit 900 --capacity 8736
```
"""

from __future__ import annotations

import argparse
import sys

from loadtest.ceilings import ceiling
from loadtest.simulate import simulation_parser
from loadtest.trace import read_trace
from loadtest.workload import build_workload
from prefixmesh.eviction import EVICTION_POLICIES


def window_rates(args: argparse.Namespace, first: int) -> dict[str, float]:
    """Hit rate per policy (and ``belady``) on the window from request ``first``."""
    rows = read_trace(args.trace)
    t0 = rows[0].timestamp_ms
    args.trace_start = (rows[first].timestamp_ms - t0) / 1000.0
    requests = build_workload(args)
    return {
        name: ceiling(requests, args.sim_block_size, args.capacity, eviction=name).hit_rate
        for name in (*EVICTION_POLICIES, "belady")
    }


def main(argv: list[str] | None = None) -> int:
    parser = simulation_parser("python -m loadtest.eviction_table")
    g = parser.add_argument_group("eviction table")
    g.add_argument("--first", default="0", help="first request index of each window, comma "
                   "separated (default: 0)")  # fmt: skip
    g.add_argument("--capacity", type=int, default=8736,
                   help="blocks of the one cache (default: 8736, three 2,912-block pools)")  # fmt: skip
    args = parser.parse_args(argv)
    args.workload = "trace"
    if args.capacity < 1:
        parser.error(f"--capacity must be >= 1 (got {args.capacity})")
    others = [p for p in EVICTION_POLICIES if p != "lru"]
    print(f"| window ({args.limit} requests from) | " + " | ".join(EVICTION_POLICIES)
          + " | belady | headroom | " + " | ".join(f"{p} / lru" for p in others) + " |")  # fmt: skip
    print("|---" * (len(EVICTION_POLICIES) + 3 + len(others)) + "|")
    for first in (int(x) for x in args.first.split(",")):
        r = window_rates(args, first)
        lru = r["lru"] or 1e-12
        cells = [f"{100 * r[p]:.1f}%" for p in (*EVICTION_POLICIES, "belady")]
        cells.append(f"{r['belady'] / lru:.2f}x")
        cells += [f"{r[p] / lru:.3f}x" for p in others]
        print(f"| {first} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
