"""``prefixmesh bench prefix``: 16 requests sharing a 1,024-token prefix: the cached tokens
reported, and the prefill time of a cache hit against the same prompt cold."""

from __future__ import annotations

import random
import time

from replica.bench.timing import make_llm
from replica.sampling_params import SamplingParams

HELP = "prefix-cache hits: cached tokens and the prefill time of a hit vs cold"


def add_arguments(parser) -> None:
    parser.add_argument("--prefix-len", type=int, default=1024)


def run(args) -> dict:
    llm = make_llm(args)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(1)
    prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(100, vocab) for _ in range(16)] for _ in range(16)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([[5, 6, 7]], one)  # warm-up

    def timed(batch):
        start = time.perf_counter()
        outs = llm.generate(batch, one)
        return time.perf_counter() - start, outs

    llm.engine.reset_prefix_cache()
    cold_s, _ = timed(prompts[:1])  # prefill of the full prompt, nothing cached
    warm_s, _ = timed([prompts[0][:-16] + prompts[1][-16:]])  # same prefix, new suffix
    llm.engine.reset_prefix_cache()
    all_s, outs = timed(prompts)  # 16 together on a cold cache: 15 reuse the first
    cached = [o.num_cached_tokens for o in outs]
    llm.engine.reset_prefix_cache()
    hits_before = llm.engine.get_stats().prefix_cache_hits
    timed(prompts[:1])
    rest_s, outs = timed(prompts[1:])
    result = {
        "prefix_len": args.prefix_len,
        "cold_prefill_s": cold_s,
        "hit_prefill_s": warm_s,
        "speedup": cold_s / warm_s,
        "sixteen_together_s": all_s,
        "cached_tokens_sixteen_together": sum(cached),
        "cached_tokens_fifteen_after_first": sum(o.num_cached_tokens for o in outs),
        "hits_counted": llm.engine.get_stats().prefix_cache_hits - hits_before,
    }
    print(
        f"prefill of a {args.prefix_len + 16}-token prompt: cold {cold_s * 1000:.0f} ms, "
        f"cache hit on the {args.prefix_len}-token prefix {warm_s * 1000:.0f} ms "
        f"({result['speedup']:.1f}x faster)"
    )
    print(
        f"16 requests sharing the prefix: {all_s:.2f} s together on a cold cache, cached tokens "
        f"reported {sum(cached)}; the 15 after the first alone: "
        f"{result['cached_tokens_fifteen_after_first']} cached tokens (>= 15 x 1008 = 15120)"
    )
    return result
