"""``prefixmesh bench chunked``: a long prompt arriving among 16 streaming requests: their worst
inter-token gap with and without the arrival, next to the time of one chunk alone."""

from __future__ import annotations

import time

from replica.bench.timing import make_llm, random_prompts
from replica.engine_request import EngineRequest
from replica.sampling_params import SamplingParams

HELP = "chunked prefill: streams' worst gap when a long prompt arrives"


def add_arguments(parser) -> None:
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--long-len", type=int, default=4000)
    parser.add_argument("--stream-tokens", type=int, default=48)


def run(args) -> dict:
    llm = make_llm(args, max_num_batched_tokens=args.chunk)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    streams = random_prompts(16, 64, vocab, seed=2)
    long_prompt = random_prompts(1, args.long_len, vocab, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)

    def run(with_arrival: bool) -> float:
        engine.reset_prefix_cache()
        for i, p in enumerate(streams):
            engine.add(EngineRequest(f"s{i}-{with_arrival}", p, params))
        last: dict[str, float] = {}
        worst = 0.0
        steps = 0
        while engine.has_unfinished_requests():
            if with_arrival and steps == 4:
                engine.add(
                    EngineRequest(
                        f"long-{time.perf_counter()}", long_prompt, SamplingParams(max_tokens=1)
                    )
                )
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id.startswith("s"):
                    if o.request_id in last and steps > 1:
                        worst = max(worst, now - last[o.request_id])
                    last[o.request_id] = now
            steps += 1
        return worst

    run(False)  # warm-up
    base = run(False)
    with_long = run(True)
    # The time of one chunk alone: the long prompt prefilled with nothing else running, chunk
    # by chunk under the same budget; its slowest chunk (the last, attending to the longest
    # prefix) is what an arrival can add to a stream's gap at most.
    engine.reset_prefix_cache()
    engine.add(EngineRequest("alone", long_prompt, SamplingParams(max_tokens=1)))
    chunk_times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        chunk_times.append(time.perf_counter() - t0)
    one_chunk = max(chunk_times)
    result = {
        "chunk_tokens": args.chunk,
        "long_prompt_tokens": args.long_len,
        "worst_gap_without_s": base,
        "worst_gap_with_s": with_long,
        "increase_s": with_long - base,
        "slowest_chunk_alone_s": one_chunk,
        "chunk_times_alone_s": chunk_times,
    }
    print(
        f"16 streams, worst inter-token gap: {base * 1000:.0f} ms alone, {with_long * 1000:.0f} ms "
        f"with a {args.long_len}-token arrival chunked by {args.chunk} "
        f"(+{(with_long - base) * 1000:.0f} ms; the slowest {args.chunk}-token chunk of that "
        f"prompt alone takes {one_chunk * 1000:.0f} ms, the first {chunk_times[0] * 1000:.0f} ms)"
    )
    return result
