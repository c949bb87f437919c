"""Integration tier: the real SmolLM2-135M-Instruct against Hugging Face ``generate``."""

from __future__ import annotations

import pytest
import torch

from replica import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = (
    "The history of computing is a story of people who wanted machines to do their arithmetic. "
    "Early mechanical calculators could add and subtract; later designs stored programs in "
    "memory, and the transistor made them small and cheap. Today a phone holds more memory "
    "than the rooms full of equipment that guided the first flights to the moon. "
    "Language models predict the next token of a text from the tokens before it, and serving "
    "them efficiently means keeping the keys and values of earlier tokens in a cache. "
)
LENGTHS = [5, 23, 64, 150, 333, 640, 1000, 1500]


@pytest.fixture(scope="module")
def llm_fp32(smollm2_files):
    return LLM("smollm2", dtype="float32", max_num_batched_tokens=2048)


def prompts_of_lengths(llm: LLM) -> list[list[int]]:
    ids = llm.tokenizer.encode(TEXT * 40)
    return [ids[i * 7 : i * 7 + n] for i, n in enumerate(LENGTHS)]


def test_batch_of_8_matches_hugging_face_generate(llm_fp32, smollm2_files):
    from transformers import AutoModelForCausalLM

    prompts = prompts_of_lengths(llm_fp32)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = llm_fp32.generate(prompts, params)  # all 8 in one continuous batch
    llm_fp32.engine.check_integrity()
    hf = AutoModelForCausalLM.from_pretrained(smollm2_files.path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs):
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverged"


def test_chat_answer_and_prefix_cache_hit(llm_fp32):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm_fp32.tokenizer.encode_chat(messages)
    params = SamplingParams(temperature=0, max_tokens=30)
    first = llm_fp32.generate([prompt], params)[0]
    second = llm_fp32.generate([prompt], params)[0]
    assert "Paris" in first.text and first.finish_reason == "stop"
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens == (len(prompt) - 1) // 16 * 16


def test_bfloat16_agrees_with_float32_on_95_percent_of_tokens(llm_fp32):
    # Teacher-forced: at every position of float32's greedy continuation, bfloat16 predicts the
    # next token from the same context (prefix caching makes each such request a few tokens of
    # work), so one early divergence cannot drag the rest of a sequence along.
    prompts = prompts_of_lengths(llm_fp32)
    steps = 24
    reference = llm_fp32.generate(
        prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    )
    llm_bf16 = LLM("smollm2", dtype="bfloat16", max_num_batched_tokens=2048)
    forced = [p + out.token_ids[:i] for p, out in zip(prompts, reference) for i in range(steps)]
    expected = [t for out in reference for t in out.token_ids]
    outputs = llm_bf16.generate(forced, SamplingParams(temperature=0, max_tokens=1))
    llm_bf16.engine.check_integrity()
    agree = sum(o.token_ids[0] == t for o, t in zip(outputs, expected)) / len(expected)
    assert agree >= 0.95, f"bfloat16 chose float32's token at {agree:.1%} of {len(expected)}"
