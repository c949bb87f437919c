"""``prefixmesh bench memory``: KV slots allocated against used per running request, next to
the concurrency a contiguous max-length reservation would allow."""

from __future__ import annotations

import random

from replica.bench.timing import make_llm, random_prompts
from replica.engine_request import EngineRequest
from replica.sampling_params import SamplingParams

HELP = "paged KV memory: slots allocated vs used per running request"


def add_arguments(parser) -> None:
    pass


def run(args) -> dict:
    llm = make_llm(args)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(4)
    prompts = [random_prompts(1, rng.randint(20, 600), vocab, seed=i)[0] for i in range(32)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(8, 64), ignore_eos=True)
        for _ in prompts
    ]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add(EngineRequest(str(i), p, sp))
    worst_waste_per_req = 0.0
    samples = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        if running:
            allocated = sum(len(s.block_table) for s in running) * engine.block_size
            used = sum(s.num_computed_tokens for s in running)
            worst_waste_per_req = max(worst_waste_per_req, (allocated - used) / len(running))
            samples += 1
    bs = engine.block_size
    pool_tokens = engine.block_manager.num_blocks * bs
    mean_len = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params)) / len(prompts)
    result = {
        "block_size": bs,
        "worst_waste_slots_per_running_request": worst_waste_per_req,
        "pool_tokens": pool_tokens,
        "max_model_len": engine.max_model_len,
        "contiguous_max_len_concurrency": pool_tokens // engine.max_model_len,
        "paged_concurrency_at_mean_len": int(pool_tokens // mean_len),
        "steps_sampled": samples,
    }
    print(
        f"allocated - used KV slots per running request: at most {worst_waste_per_req:.1f} "
        f"(one block = {bs} slots) over {samples} steps"
    )
    print(
        f"pool of {pool_tokens} token slots: contiguous max-length ({engine.max_model_len}) "
        f"reservations fit {result['contiguous_max_len_concurrency']} requests; paged blocks fit "
        f"~{result['paged_concurrency_at_mean_len']} requests of this workload's mean length "
        f"{mean_len:.0f}"
    )
    return result
