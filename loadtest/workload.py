"""Building a scheduled workload from command-line options."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.arrivals import ArrivalSpec, schedule
from loadtest.request import LoadRequest
from loadtest.synthetic import RandomSpec, SharedPrefixSpec, random_requests, shared_prefix_requests
from loadtest.text import TextBlocks
from loadtest.tokens import TokenBlocks
from loadtest.trace import TraceOptions, read_trace, trace_requests

SAMPLE_TRACE = Path(__file__).parent / "data" / "sample_trace.jsonl"
WORKLOADS = ("trace", "shared-prefix", "random")
PROMPT_FORMATS = ("token-ids", "text")


def build_workload(args: argparse.Namespace) -> list[LoadRequest]:
    """Requests with planned times (or none for closed loop), capped by ``--limit``."""
    if args.workload == "trace":
        opts = TraceOptions(
            tokens_per_hash_id=args.tokens_per_hash_id,
            max_output_tokens=args.max_output_tokens,
            max_input_tokens=args.max_input_tokens,
            start_s=args.trace_start,
            window_s=args.trace_window,
            limit=args.limit,
        )
        blocks = TokenBlocks(args.tokens_per_hash_id, args.vocab_size, args.min_token_id, args.seed)
        texts = None
        if getattr(args, "prompt_format", "token-ids") == "text":
            # one word per token and a full stop: a sentence per hash id of that many tokens
            texts = TextBlocks(max(1, args.tokens_per_hash_id - 1), args.seed)
        requests = trace_requests(read_trace(args.trace or SAMPLE_TRACE), blocks, opts, texts)
    else:
        if getattr(args, "prompt_format", "token-ids") == "text":
            raise ValueError("--prompt-format text needs a trace workload (--trace)")
        blocks = TokenBlocks(1, args.vocab_size, args.min_token_id, args.seed)
        if args.workload == "shared-prefix":
            spec = SharedPrefixSpec(
                num_groups=args.num_groups,
                prompts_per_group=args.prompts_per_group,
                system_prompt_len=args.system_prompt_len,
                question_len=args.question_len,
                output_len=args.output_len,
                zipf=args.zipf,
                turns=args.turns,
                seed=args.seed,
            )
            requests = shared_prefix_requests(spec, blocks)
        elif args.workload == "random":
            rspec = RandomSpec(
                args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed
            )
            requests = random_requests(rspec, blocks)
        else:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}")
        if args.limit is not None:
            requests = requests[: args.limit]
        if args.max_output_tokens is not None:
            for r in requests:
                r.max_tokens = min(r.max_tokens, args.max_output_tokens)
        if args.max_input_tokens is not None:
            for r in requests:
                r.token_ids = r.token_ids[: args.max_input_tokens]
    arrival = args.arrival or ("trace" if args.workload == "trace" else "poisson")
    schedule(
        requests,
        ArrivalSpec(arrival, args.rate, args.burstiness, args.speedup, args.concurrency, args.seed),
    )
    shard = getattr(args, "shard", None)
    if shard is not None:  # after scheduling: each request keeps its time in the whole workload
        k, n = shard
        requests = [r for r in requests if r.index % n == k]
    return requests


def parse_shard(value: str) -> tuple[int, int]:
    """``--shard K/N`` as (K, N)."""
    try:
        k, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N, e.g. 0/2 (got {value!r})") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"K/N needs 0 <= K < N (got {value!r})")
    return k, n
