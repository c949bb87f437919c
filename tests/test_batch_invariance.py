"""Batch-invariant mode (``EngineConfig.batch_invariant``, docs/fetch.md): a prompt whose prefix
was computed in an earlier request, or whose tokens were chunked differently, gives the cold
run's results bit for bit, in float32 and bfloat16.

The matmuls' half of the contract is checked at SmolLM2's shapes under every ISA cap in
tests/test_cpu_linear.py; the SmolLM2 fetch of the issue in tests/test_peer_fetch.py (slow)."""

from __future__ import annotations

import random

import pytest

from replica import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
BS = 16


def make_llm(model_dir, dtype: str, budget: int = 1024, invariant: bool = True) -> LLM:
    return LLM(str(model_dir), dtype=dtype, num_kv_blocks=64, block_size=BS,
               max_num_batched_tokens=budget, batch_invariant=invariant)  # fmt: skip


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 400) for _ in range(n)]


def run(llm: LLM, ids: list[int]) -> tuple[list[int], list, int]:
    out = llm.generate([ids], GREEDY)[0]
    sample = out.outputs[0]
    return sample.token_ids, sample.logprobs, out.num_cached_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("suffix", [1, 2, 17])
def test_a_prefix_hit_and_chunking_give_the_cold_bits(tiny_model_dir, dtype, suffix):
    """Greedy tokens and their top-5 log-probabilities (floats, compared exactly) after a local
    prefix-cache hit, and after a prefill chunked by a 32-token budget, equal one cold prefill's.
    With one new token after the hit (``suffix=1``), or a chunk leaving one token behind, that
    token would run in the decode attention kernel, which rounds otherwise than the prefill
    kernel: batch-invariant mode keeps two tokens uncached and chunks a prompt so that no lone
    token is left."""
    ids = prompt(6 * BS + suffix)
    warm, cold, chunked = (make_llm(tiny_model_dir, dtype, b) for b in (1024, 1024, 32))
    warm.generate([ids[: 6 * BS]], GREEDY)  # the prefix, computed in a request of its own
    hit = run(warm, ids)
    want = run(cold, ids)
    assert want[2] == 0 and hit[2] == (6 if suffix >= 2 else 5) * BS
    assert hit[:2] == want[:2]
    assert run(chunked, ids)[:2] == want[:2]
    for llm in (warm, cold, chunked):
        llm.engine.check_integrity()


def test_invariant_chunks_never_leave_a_lone_prompt_token(tiny_model_dir):
    """A 65-token prompt under a 32-token budget: chunks 32, 31, 2 (not 32, 32, 1)."""
    llm = make_llm(tiny_model_dir, "float32", budget=32)
    runner = llm.engine.runner
    execute, chunks = runner.execute, []

    def recording(sched):
        chunks.extend(item.num_new_tokens for item in sched.scheduled)
        return execute(sched)

    runner.execute = recording
    llm.generate([prompt(65)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert chunks == [32, 31, 2, 1]  # the last step: the decode of the second output token
    llm.engine.check_integrity()
