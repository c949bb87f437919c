"""The whole engine on the Triton backend: greedy output equals the torch backend's.

Without CUDA the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), so this checks
the kernels inside the real step loop (continuous batching, chunked prefill, prefix-cache hits)
on the tiny random Llama.
"""

from __future__ import annotations

import torch

from replica import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHARED = (
    "The router sends every request to the replica whose prefix cache already holds the "
    "longest part of its prompt, so a shared system prompt is computed once per replica. "
)
FIRST_ROUND = [SHARED + "Tell me about paged attention.", "Hi", SHARED + "What is a block table?"]
# Shares SHARED with the first round: its prefill starts after a cached prefix.
SECOND_ROUND = [SHARED + "And what about chunked prefill?", "Hi there, how are you today?"]


def greedy(model_dir, backend: str) -> tuple[list[list[int]], list[list[int]], list[int]]:
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        device=DEVICE,  # both backends on the same device: compiled kernels on a GPU
        attention_backend=backend,
        # Small steps so long prompts prefill in several chunks alongside running decodes.
        max_num_batched_tokens=32,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(FIRST_ROUND, params)
    second = llm.generate(SECOND_ROUND, params)
    return (
        [out.outputs[0].token_ids for out in first],
        [out.outputs[0].token_ids for out in second],
        [out.num_cached_tokens for out in second],
    )


def test_triton_backend_greedy_matches_torch(tiny_model_dir, monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch_first, torch_second, torch_cached = greedy(tiny_model_dir, "torch")
    triton_first, triton_second, triton_cached = greedy(tiny_model_dir, "triton")
    assert all(len(ids) == 8 for ids in torch_first + torch_second)
    assert triton_first == torch_first
    assert triton_second == torch_second
    # The shared prefix was served from the prefix cache, so the cached-prefix path ran.
    assert torch_cached[0] > 0 and triton_cached == torch_cached


def test_triton_backend_selected_by_name():
    from kernels import get_backend

    assert get_backend("triton", "cpu").name == "triton"
    assert get_backend("auto", "cuda:0").name == "triton"
    assert get_backend("auto", "cpu").name == "torch"
