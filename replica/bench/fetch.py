"""``prefixmesh bench fetch``: two replicas (in this process, over loopback gRPC). A long prompt
goes to replica A; the same prompt with a new suffix goes to replica B, with a fetch hint naming
A (what a router sends when it passes the warm replica over). Reported: B's cached and fetched
tokens, its time to first token with the prefix fetched against B computing the whole prompt
cold (the same prompt, B's prefix cache dropped, alternating), the transfer's MB/s, and whether
the greedy outputs are token-identical."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

HELP = "KV fetch between replicas: time to first token with the prefix fetched vs cold"


def add_arguments(parser) -> None:
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)


async def _replica(args, replica_id: str):
    from replica.engine import LLMEngine
    from replica.server.config import ServerConfig
    from replica.server.server import ReplicaServer

    config = ServerConfig(
        port=0, replica_id=replica_id, model=args.model, dtype=args.dtype,
        block_size=args.block_size, num_blocks=4 * (args.prompt_len // args.block_size + 8),
        max_model_len=args.prompt_len + args.suffix_len + args.max_tokens + 64,
        threads=args.threads or 0, max_num_batched_tokens=2048,
        batch_invariant=args.batch_invariant,
    )  # fmt: skip
    engine = await asyncio.to_thread(LLMEngine, config.engine_config())
    server = ReplicaServer(config, engine)
    await server.start()
    return server


async def _generate(stub, ids: list[int], max_tokens: int, hint=None):
    """Tokens, usage, and seconds to the first token, as a client sees them."""
    from proto import prefixmesh_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    if hint is not None:
        request.fetch_hint.CopyFrom(hint)
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    usage = pb.Usage()
    async for msg in stub.Generate(request, timeout=600):
        if msg.token_ids and first is None:
            first = time.perf_counter() - start
        tokens += msg.token_ids
        if msg.finish_reason:
            usage = msg.usage
    return tokens, usage, first


async def _run(args) -> dict:
    from prefixmesh.tls import aio_channel
    from proto import prefixmesh_pb2 as pb
    from proto import prefixmesh_pb2_grpc as pb_grpc

    a = await _replica(args, "bench-a")
    b = await _replica(args, "bench-b")
    assert b.fetcher is not None
    b.fetcher.cost.prefill_tokens_per_s = 1e-3  # always fetch: this measures the fetch
    b.fetcher.cost.record_prefill = lambda tokens, seconds: None
    channels = [aio_channel(f"127.0.0.1:{s.port}", None) for s in (a, b)]
    gen_a, gen_b = (pb_grpc.GeneratorStub(c) for c in channels)
    hint = pb.FetchHint(replica_id="bench-a", address=f"127.0.0.1:{a.port}", num_blocks=1 << 20)
    vocab = int(a.engine.model_config.vocab_size)
    rng = random.Random(0)
    rows = []
    try:
        await _generate(gen_b, [5, 6, 7], 2)  # warm-up of both, and of B's fetch path
        for r in range(args.rounds):
            prefix = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
            prompt = prefix + [rng.randrange(100, vocab) for _ in range(args.suffix_len)]
            await _generate(gen_a, prefix, 1)
            row: dict = {}
            for kind in ("cold", "fetched") if r % 2 == 0 else ("fetched", "cold"):
                await b.loop.call(lambda e: e.reset_prefix_cache())
                tokens, usage, ttft = await _generate(
                    gen_b, prompt, args.max_tokens, hint if kind == "fetched" else None
                )
                row[kind] = {"ttft_s": ttft, "tokens": tokens, "cached": usage.cached_tokens,
                             "fetched": usage.fetched_tokens}  # fmt: skip
                if kind == "fetched":
                    row["transfer"] = b.fetcher.last_transfer
            # A itself on the same prompt: a local hit on the very KV that B fetched.
            tokens, usage, ttft = await _generate(gen_a, prompt, args.max_tokens)
            row["holder"] = {"ttft_s": ttft, "tokens": tokens, "cached": usage.cached_tokens}
            rows.append(row)
            await a.loop.call(lambda e: e.reset_prefix_cache())
    finally:
        for c in channels:
            await c.close()
        for s in (a, b):
            await s.shutdown()
    return _summary(args, rows, str(a.engine.dtype).removeprefix("torch."))


def _summary(args, rows: list[dict], dtype: str) -> dict:
    cold = statistics.median(r["cold"]["ttft_s"] for r in rows)
    fetched = statistics.median(r["fetched"]["ttft_s"] for r in rows)
    mb_s = statistics.median(r["transfer"][0] / r["transfer"][1] / 1e6 for r in rows)
    mb = rows[0]["transfer"][0] / 1e6
    result = {
        "prompt_tokens": args.prompt_len + args.suffix_len,
        "dtype": dtype,
        "cached_tokens": [r["fetched"]["cached"] for r in rows],
        "fetched_tokens": [r["fetched"]["fetched"] for r in rows],
        "ttft_cold_s": [r["cold"]["ttft_s"] for r in rows],
        "ttft_fetched_s": [r["fetched"]["ttft_s"] for r in rows],
        "speedup": cold / fetched,
        "transfer_mb": mb,
        "transfer_mb_per_s": mb_s,
        "ttft_holder_hit_s": [r["holder"]["ttft_s"] for r in rows],
        "identical_to_cold": [r["cold"]["tokens"] == r["fetched"]["tokens"] for r in rows],
        "identical_to_holder_hit": [r["holder"]["tokens"] == r["fetched"]["tokens"] for r in rows],
        "cold_tokens": [r["cold"]["tokens"] for r in rows],
        "fetched_tokens_out": [r["fetched"]["tokens"] for r in rows],
    }
    print(
        f"B, {result['prompt_tokens']}-token prompt whose first {args.prompt_len} tokens A "
        f"holds ({dtype}, {args.rounds} rounds, medians):\n"
        f"  cached tokens {result['cached_tokens']}, of which fetched {result['fetched_tokens']}\n"
        f"  time to first token: cold {cold * 1000:.0f} ms, fetched {fetched * 1000:.0f} ms "
        f"({result['speedup']:.1f}x faster)\n"
        f"  transfer: {mb:.1f} MB at {mb_s:.0f} MB/s (FetchBlocks stream + insert into B's "
        f"pool)\n  greedy output identical to B's cold run: {result['identical_to_cold']}; "
        f"to A's own cache hit on the same KV: {result['identical_to_holder_hit']}"
    )
    return result


def run(args) -> dict:
    from prefixmesh import event_loop

    return event_loop.run(_run(args))
