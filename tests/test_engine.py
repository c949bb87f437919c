"""Engine correctness on the tiny random Llama: parity with Hugging Face, and batching, prefix
caching, chunking, preemption and parallel sampling never changing greedy output."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_tiny_model_dir, pair_modes

from kernels import cpu_linear
from kernels.interface import key_layout_of
from replica import LLM, SamplingParams
from replica.engine_request import EngineRequest

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def random_prompts(n: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 400) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def make_llm(tiny_model_dir, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(str(tiny_model_dir), **kwargs)


def run_greedy(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return [o.token_ids for o in outputs]


def run_until_done(engine, request_id: str, max_steps: int = 200) -> tuple[list[int], int]:
    """Step until nothing is left; ``request_id``'s tokens and the cached tokens it reported."""
    got: list[int] = []
    cached = -1
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id == request_id:
                got.extend(out.new_token_ids)
                cached = out.num_cached_tokens
    return got, cached


def use_f32_gemm(monkeypatch, mode: str) -> None:
    """Pack float32 weights for ``mode``'s GEMM (kernels/cpu_linear.py) in engines made next."""
    monkeypatch.setenv(cpu_linear.F32_GEMM_ENV, mode)


def check_f32_gemm(llm: LLM, mode: str) -> None:
    # With the kernels built, "panels" must really put every layer on the panel GEMM.
    from kernels import cpu_ops

    if mode == "panels" and cpu_ops.load() is not None:
        layer = llm.engine.runner.model.layers[0]
        assert all(
            isinstance(layer[w], cpu_linear.PanelPacked) for w in ("qkv", "o", "gate_up", "down")
        )


# Both float32 GEMMs on every machine: oneDNN, and our panel GEMM (kernels/csrc/panel_gemm.cpp).
F32_GEMMS = ["onednn", "panels"]


@pytest.mark.parametrize("gemm", F32_GEMMS)
def test_batch_matches_hugging_face(tiny_model_dir, hf_model, monkeypatch, gemm):
    use_f32_gemm(monkeypatch, gemm)
    prompts = random_prompts(8, (1, 300))
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=4096)
    check_f32_gemm(llm, gemm)
    ours = run_greedy(llm, prompts)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf_model, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("keys", ["rows", "tokens", "heads"])
def test_every_kv_cache_layout_matches_hugging_face(tiny_model_dir, hf_model, monkeypatch, keys):
    # Keys in rows (AMX machines' bfloat16 default), token-minor (every other CPU's, where the
    # kernels build) or head-major: prefill, chunked prefill and decode read the layout the
    # engine allocated.
    from kernels import cpu_ops

    monkeypatch.setenv("PREFIXMESH_KEY_LAYOUT", keys)
    prompts = random_prompts(6, (1, 300), seed=11)
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=128)
    if cpu_ops.load() is not None:
        assert llm.engine.runner.key_layout == keys
        assert key_layout_of(llm.engine.runner.kv_caches[0][0]) == keys
    for prompt, got in zip(prompts, run_greedy(llm, prompts)):
        assert got == hf_greedy(hf_model, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("gemm", F32_GEMMS)
def test_qwen2_with_qkv_bias_matches_hugging_face(tmp_path, monkeypatch, gemm):
    from transformers import AutoModelForCausalLM

    use_f32_gemm(monkeypatch, gemm)
    folder = make_tiny_model_dir(tmp_path / "qwen2", family="qwen2")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = random_prompts(4, (1, 120), seed=3)
    # min_tokens masks EOS as Hugging Face's min_new_tokens does (ignore_eos alone does not).
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    llm = make_llm(folder)
    check_f32_gemm(llm, gemm)
    ours = run_greedy(llm, prompts, params)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_late_arrivals_join_and_match_solo_runs(tiny_model_dir):
    prompts = random_prompts(6, (5, 120), seed=1)
    llm = make_llm(tiny_model_dir)
    solo = [run_greedy(llm, [p])[0] for p in prompts]
    engine = llm.engine
    for i in range(3):
        engine.add(EngineRequest(f"early{i}", prompts[i], GREEDY))
    got: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:  # the rest arrive while the first ones are decoding
            for i in range(3, 6):
                engine.add(EngineRequest(f"late{i}", prompts[i], GREEDY))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    engine.check_integrity()
    assert engine.get_stats().running == 0
    for i in range(6):
        assert got[f"early{i}" if i < 3 else f"late{i}"] == solo[i]


def test_prefix_caching_on_and_off_agree_and_reports_hits(tiny_model_dir):
    rng = random.Random(2)
    shared = [rng.randrange(5, 400) for _ in range(100)]
    prompts = [
        shared + [rng.randrange(5, 400) for _ in range(rng.randint(1, 30))] for _ in range(6)
    ]
    with_cache = make_llm(tiny_model_dir)
    first = with_cache.generate(prompts[:1], GREEDY)[0]
    rest = with_cache.generate(prompts[1:], GREEDY)
    without = make_llm(tiny_model_dir, enable_prefix_caching=False)
    assert [first.token_ids] + [o.token_ids for o in rest] == run_greedy(without, prompts)
    assert first.num_cached_tokens == 0
    assert all(o.num_cached_tokens == 96 for o in rest)  # 6 full blocks of the shared 100
    stats = with_cache.engine.get_stats()
    assert stats.prefix_cache_hits == 5 * 96
    assert without.engine.get_stats().prefix_cache_hits == 0


def test_identical_prompt_never_reuses_its_last_token(tiny_model_dir):
    prompt = random_prompts(1, (64, 64), seed=3)[0]  # exactly 4 blocks
    llm = make_llm(tiny_model_dir)
    a = llm.generate([prompt], GREEDY)[0]
    b = llm.generate([prompt], GREEDY)[0]
    assert a.token_ids == b.token_ids
    assert b.num_cached_tokens == 48  # the last block holds the last token: recomputed


def test_chunked_prefill_matches_unchunked(tiny_model_dir):
    prompts = random_prompts(4, (150, 300), seed=4)
    whole = run_greedy(make_llm(tiny_model_dir, max_num_batched_tokens=4096), prompts)
    chunked = make_llm(tiny_model_dir, max_num_batched_tokens=32)
    assert run_greedy(chunked, prompts) == whole


def test_preemption_under_memory_pressure_completes_everything(tiny_model_dir):
    prompts = random_prompts(8, (20, 60), seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = run_greedy(make_llm(tiny_model_dir), prompts, params)
    tight = make_llm(tiny_model_dir, num_kv_blocks=12, max_num_batched_tokens=128)
    assert run_greedy(tight, prompts, params) == roomy
    stats = tight.engine.get_stats()
    assert stats.preemptions > 0
    assert stats.free_blocks == stats.num_blocks  # nothing leaked
    assert stats.finished_by_reason == {"length": 8}


def test_priority_scheduling_serves_lower_value_first(tiny_model_dir):
    llm = make_llm(tiny_model_dir, scheduling_policy="priority", max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add(EngineRequest("low", [5, 6, 7], params, priority=5))
    engine.step()  # "low" is running
    engine.add(EngineRequest("high", [8, 9, 10], params, priority=0))
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]
    assert engine.get_stats().preemptions == 1
    engine.check_integrity()


def test_parallel_samples_share_prompt_blocks_and_copy_on_write(tiny_model_dir):
    prompt = random_prompts(1, (40, 40), seed=6)[0]  # 2 full blocks + 8 tokens
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    engine.add(EngineRequest("r", prompt, params))
    engine.step()  # prefill, fork, first token of each sample
    seqs = engine._requests["r"].sequences
    assert len(seqs) == 3
    assert seqs[0].block_table[:2] == seqs[1].block_table[:2] == seqs[2].block_table[:2]
    engine.step()  # each sample writes into the shared partial block: copy on write
    tails = {s.block_table[2] for s in seqs}
    assert len(tails) == 3
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    # Seeded samples are reproducible and differ from one another.
    out1 = llm.generate([prompt], params)[0]
    out2 = llm.generate([prompt], params)[0]
    assert [o.token_ids for o in out1.outputs] == [o.token_ids for o in out2.outputs]
    assert len({tuple(o.token_ids) for o in out1.outputs}) == 3


def test_seeded_request_is_independent_of_batch_mates(tiny_model_dir):
    prompts = random_prompts(5, (10, 50), seed=8)
    llm = make_llm(tiny_model_dir)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompts, [seeded] + [others] * 4)
    assert batch[0].token_ids == alone


def test_cache_salt_isolates_tenants(tiny_model_dir):
    prompt = random_prompts(1, (80, 80), seed=9)[0]
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    for rid, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("a2", "tenant-a")):
        engine.add(EngineRequest(rid, prompt, GREEDY, cache_salt=salt))
        cached = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                cached = out.num_cached_tokens
        assert cached == (64 if rid == "a2" else 0)


def test_abort_frees_blocks_at_once(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    engine.add(EngineRequest("x", random_prompts(1, (50, 50))[0], SamplingParams(max_tokens=100)))
    engine.step()
    engine.step()
    assert engine.get_stats().free_blocks < engine.get_stats().num_blocks
    engine.abort_request("x")
    engine.check_integrity()
    assert engine.get_stats().free_blocks == engine.get_stats().num_blocks
    final = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in final] == [("x", True, "abort")]
    assert not engine.has_unfinished_requests()


def test_unsent_text_comes_first_through_the_stop_string_matcher(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    prompt = random_prompts(1, (20, 20), seed=11)[0]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    free = llm.generate([prompt], greedy)[0].text
    assert free and "@" not in free

    def params(stop: str) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, stop=[stop])

    # Unsent text as a resumed replica gets it: its "@" may start the stop string, so it waits
    # for the generated text, which completes the stop string (a), does not (c), or never
    # comes (b: aborted, the held-back text is released).
    engine.add(EngineRequest("a", prompt, params("@" + free[0]), unsent_text="held@"))
    engine.add(EngineRequest("b", prompt, params("@@"), unsent_text="x@"))
    engine.add(EngineRequest("c", prompt, params("@@"), unsent_text="held@"))
    engine.abort_request("b")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    text = {r: "".join(o.new_text for o in outputs if o.request_id == r) for r in "abc"}
    assert text == {"a": "held", "b": "x@", "c": "held@" + free}
    finals = {o.request_id: o for o in outputs if o.finished}
    assert (finals["a"].finish_reason, finals["a"].stop_reason) == ("stop", "@" + free[0])
    assert next(o for o in outputs if o.request_id == "c").new_text.startswith("held@")
    with pytest.raises(ValueError, match="n == 1"):
        engine.add(EngineRequest("d", prompt, SamplingParams(n=2), unsent_text="x"))


def test_a_stop_token_releases_text_held_back_for_a_stop_string(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompt = random_prompts(1, (20, 20), seed=10)[0]
    ids = llm.generate([prompt], GREEDY)[0].token_ids
    # The first k tokens have text, and token k does not occur among them: stopping on it ends
    # the sample right after them.
    k, before = next(
        (k, text)
        for k in range(1, len(ids))
        if ids[k] not in ids[:k]
        and (text := llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k,
                                                              ignore_eos=True))[0].text)
    )  # fmt: skip
    # A stop string that the text's last character may begin: the matcher holds it back until
    # the next token, which is the stop token.
    stop = before[-1] + "\x01"
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], stop_token_ids=[ids[k]]
    )
    out = llm.generate([prompt], params)[0]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", ids[k])
    assert out.token_ids == ids[: k + 1]
    assert out.text == before  # the held-back character included, the stop token's text not
    streamed = "".join(d.new_text for d in llm.generate_stream([prompt], params))
    assert streamed == before


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompt = random_prompts(1, (20, 20), seed=10)[0]
    free = llm.generate([prompt], GREEDY)[0].token_ids
    stop_id = free[5]
    first = free.index(stop_id)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    )
    assert out[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop_id
    assert out[0].token_ids == free[: first + 1]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id], min_tokens=10),
    )
    assert len(out[0].token_ids) >= 10 and stop_id not in out[0].token_ids[:10]
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0].finish_reason in (
        "length",
        "stop",
    )


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([10**6], SamplingParams(), "prompt_token_ids"),
        ([1] * 5000, SamplingParams(), "max_model_len"),
    ],
)
def test_bad_requests_name_the_field(tiny_model_dir, prompt, params, field):
    llm = make_llm(tiny_model_dir)
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt] if prompt != [] else [[]], params)
    assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_swap_preemption_keeps_kv_and_output(tiny_model_dir):
    # The host pool is meant for devices with memory of their own; forcing it on the CPU runs the
    # same swap-out / swap-in path (device tensors and host tensors are both in RAM here).
    prompts = random_prompts(8, (20, 60), seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = run_greedy(make_llm(tiny_model_dir), prompts, params)
    tight = make_llm(
        tiny_model_dir,
        num_kv_blocks=12,
        max_num_batched_tokens=128,
        preemption_mode="swap",
        num_host_blocks=64,
    )
    assert run_greedy(tight, prompts, params) == roomy
    stats = tight.engine.get_stats()
    assert stats.swapped_out > 0
    assert stats.free_blocks == stats.num_blocks
    assert tight.engine.host_pool.num_free_blocks == 64


def test_bfloat16_engine_agrees_with_float32(tiny_model_dir):
    # bfloat16 runs the matmuls and the C++ decode kernel in reduced precision; its greedy
    # tokens must still mostly agree with float32's.
    prompts = random_prompts(8, (5, 80), seed=11)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fp32 = run_greedy(make_llm(tiny_model_dir), prompts, params)
    bf16 = run_greedy(make_llm(tiny_model_dir, dtype="bfloat16"), prompts, params)
    first_agree = sum(a[0] == b[0] for a, b in zip(fp32, bf16))
    assert first_agree >= 6, (fp32, bf16)


@pytest.mark.parametrize("mode", pair_modes())
def test_bfloat16_engine_on_the_pair_gemm_agrees_with_float32(tiny_model_dir, monkeypatch, mode):
    # The same check with every bfloat16 matmul on the pair-dot-product GEMM
    # (kernels/csrc/pair_gemm.cpp): emulated on any CPU, on vdpbf16ps where the CPU has it.
    monkeypatch.setenv(cpu_linear.GEMM_ENV, mode)
    prompts = random_prompts(8, (5, 80), seed=11)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fp32 = run_greedy(make_llm(tiny_model_dir), prompts, params)
    llm = make_llm(tiny_model_dir, dtype="bfloat16")
    layer = llm.engine.runner.model.layers[0]
    assert all(isinstance(layer[w], cpu_linear.PairPacked) for w in ("qkv", "o", "gate_up", "down"))
    bf16 = run_greedy(llm, prompts, params)
    first_agree = sum(a[0] == b[0] for a, b in zip(fp32, bf16))
    assert first_agree >= 6, (fp32, bf16)
    llm.engine.check_integrity()


def test_a_sequence_never_outgrows_the_kv_pool(tiny_model_dir):
    llm = make_llm(tiny_model_dir, num_kv_blocks=4)  # 64 token slots in all
    assert llm.engine.max_model_len == 64
    out = llm.generate(
        [random_prompts(1, (40, 40))[0]], SamplingParams(max_tokens=100, ignore_eos=True)
    )
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 24
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([[5] * 64], GREEDY)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu avx avx2 fma", "float32"),  # AVX2 only: bf16 is emulated, several times slower
        ("fpu avx2 avx512f avx512_bf16", "bfloat16"),
        ("fpu avx2 avx512f amx_bf16 amx_tile", "bfloat16"),
    ],
)
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it(
    tmp_path, monkeypatch, flags, expected
):
    from replica import engine

    monkeypatch.delenv("PREFIXMESH_CPU_ISA", raising=False)  # these flags, uncapped
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    real_check = engine.cpu_has_native_bf16
    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: real_check(str(cpuinfo)))
    assert engine.default_dtype("cpu") == expected
    assert engine.default_dtype("cuda") == "bfloat16"


def test_auto_dtype_engine_uses_the_detected_dtype(tiny_model_dir):
    from replica.engine import default_dtype

    llm = make_llm(tiny_model_dir, dtype="auto")
    assert str(llm.engine.dtype) == f"torch.{default_dtype('cpu')}"


def test_a_burst_sharing_a_prefix_computes_it_once(tiny_model_dir):
    # Four 104-token requests with one 96-token prefix arrive together; a step holds 128
    # tokens. Step 1 prefills the first, and the 24 tokens left would start the second, which
    # would then compute its own copy of the prefix (its block table is set at admission). With
    # the wait, the second sits out step 1 (its next block is in flight) and takes the prefix
    # from the cache in step 2, as the later ones do either way. Outputs are the same.
    rng = random.Random(12)
    shared = [rng.randrange(5, 400) for _ in range(96)]
    prompts = [shared + [rng.randrange(5, 400) for _ in range(8)] for _ in range(4)]
    results = {}
    for wait in (True, False):
        llm = make_llm(tiny_model_dir, max_num_batched_tokens=128, wait_for_inflight_prefix=wait)
        outputs = llm.generate(prompts, GREEDY)
        llm.engine.check_integrity()
        stats = llm.engine.scheduler.stats
        results[wait] = ([o.token_ids for o in outputs], [o.num_cached_tokens for o in outputs])
        assert (stats.inflight_prefix_waits > 0) == wait
    assert results[True][0] == results[False][0]
    assert results[True][1] == [0, 96, 96, 96]
    assert results[False][1] == [0, 0, 96, 96]


def test_queued_tokens_leave_out_what_a_waiting_request_will_reuse(tiny_model_dir):
    # Routers read queued_tokens as the replica's load. A request waiting on a prefix that is
    # cached, or that a running request is prefilling, owes only the rest of its prompt.
    rng = random.Random(14)
    shared = [rng.randrange(5, 400) for _ in range(96)]
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add(EngineRequest("leader", shared + [1, 2, 3], params))
    engine.add(EngineRequest("follower", shared + [7, 8, 9], params))
    engine.add(EngineRequest("other", [rng.randrange(5, 400) for _ in range(20)], params))
    engine.step()  # the leader's first 64 tokens (4 blocks cached, the next 2 in flight)
    assert [s.request.request_id for s in engine.scheduler.running] == ["leader"]
    leader, follower, other = 99 - 64 + 5, 99 - 96 + 5, 20 + 5
    assert engine.get_stats().queued_tokens == leader + follower + other
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    engine.check_integrity()
    assert engine.get_stats().queued_tokens == 0


def test_a_request_waiting_on_a_prefix_goes_ahead_when_its_leader_is_aborted(tiny_model_dir):
    rng = random.Random(13)
    shared = [rng.randrange(5, 400) for _ in range(96)]
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=64)
    solo = run_greedy(llm, [shared + [7, 8, 9]])[0]
    llm.engine.reset_prefix_cache()
    engine = llm.engine
    engine.add(EngineRequest("leader", shared + [1, 2, 3], GREEDY))
    engine.add(EngineRequest("follower", shared + [7, 8, 9], GREEDY))
    engine.step()  # the leader's first 64 tokens
    engine.step()  # the leader's last 35; the follower waits for the prefix's last 2 blocks
    assert [s.request.request_id for s in engine.scheduler.waiting] == ["follower"]
    engine.abort_request("leader")
    got, _ = run_until_done(engine, "follower")
    engine.check_integrity()
    assert got == solo


def test_a_queued_request_keeps_the_prefix_it_was_sent_for(tiny_model_dir):
    # A router sends a request where its prefix is cached. While it waits its turn, the
    # running sequences' new blocks evict the least recently used cached blocks: marking its
    # prefix used on arrival makes them take blocks nobody is waiting for first.
    rng = random.Random(15)
    prefix = [rng.randrange(5, 400) for _ in range(64)]
    other = [rng.randrange(5, 400) for _ in range(64)]
    llm = make_llm(tiny_model_dir, num_kv_blocks=12, max_num_seqs=1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    solo = run_greedy(llm, [prefix + [9, 9, 9]])[0]
    llm.engine.reset_prefix_cache()
    run_greedy(llm, [prefix + [1], other + [1]], params)  # 4 + 4 cached blocks, prefix oldest
    engine = llm.engine
    engine.add(EngineRequest("long", [rng.randrange(5, 400) for _ in range(100)], GREEDY))
    engine.add(EngineRequest("queued", prefix + [9, 9, 9], GREEDY))  # waits behind "long" (1 seq)
    got, cached = run_until_done(engine, "queued")
    engine.check_integrity()
    assert got == solo
    assert cached == 64  # "long" took 7 blocks: the 4 free ones and 3 of the other prompt's


def _queued_behind_two(tiny_model_dir, share: float) -> tuple[list[int], int, list[int]]:
    """A prefix is cached; "q" comes for it while two requests queue ahead of it (one
    sequence at a time). The first finishes and its blocks join the cache, newer than q's
    touch on arrival; the second then needs more blocks than are free. Returns q's output,
    its cached tokens, and its output on a cold engine."""
    rng = random.Random(16)
    prefix = [rng.randrange(5, 400) for _ in range(64)]  # 4 blocks of 16
    first = [rng.randrange(5, 400) for _ in range(60)]
    second = [rng.randrange(5, 400) for _ in range(110)]
    llm = make_llm(tiny_model_dir, num_kv_blocks=12, max_num_seqs=1, waiting_prefix_share=share)
    solo = run_greedy(llm, [prefix + [9, 9, 9]])[0]
    llm.engine.reset_prefix_cache()
    run_greedy(llm, [prefix + [1]], SamplingParams(max_tokens=1, temperature=0.0))
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add(EngineRequest("first", first, params))
    engine.add(EngineRequest("second", second, params))
    engine.add(EngineRequest("q", prefix + [9, 9, 9], GREEDY))
    assert engine.block_manager.num_kept_hashes == (4 if share else 0)
    assert engine.get_stats().kept_hashes == (4 if share else 0)  # the metric's gauge
    engine.check_integrity()
    got, cached = run_until_done(engine, "q")
    engine.check_integrity()
    assert engine.block_manager.num_kept_hashes == 0
    return got, cached, solo


def test_a_waiting_request_keeps_its_prefix_while_requests_ahead_of_it_finish(tiny_model_dir):
    # Marking the prefix used on arrival is not enough under a queue: "first" finishes after
    # q arrived, so its blocks are newer in the LRU order, and "second" then evicts q's
    # prefix. Kept (the default), q's prefix goes only after every block nobody waits for.
    got, cached, solo = _queued_behind_two(tiny_model_dir, share=1.0)
    assert got == solo
    assert cached == 64
    got, cached, solo = _queued_behind_two(tiny_model_dir, share=0.0)  # touch only
    assert got == solo
    assert cached < 64


def _waiting_on_a_queued_prefix(tiny_model_dir, share: float) -> tuple[list[int], int, list[int]]:
    """ "w2" arrives while "w1", queued ahead of it, has yet to compute their shared prefix
    (nothing of it is cached). One sequence at a time: w1 computes it, then "y" finishes
    (its blocks younger than the prefix) and "x" needs more blocks than are free. Returns
    w2's output, its cached tokens, and its output on a cold engine."""
    rng = random.Random(17)
    prefix = [rng.randrange(5, 400) for _ in range(64)]  # 4 blocks of 16
    llm = make_llm(tiny_model_dir, num_kv_blocks=12, max_num_seqs=1, waiting_prefix_share=share)
    solo = run_greedy(llm, [prefix + [9, 9, 9]])[0]
    llm.engine.reset_prefix_cache()
    engine = llm.engine
    four = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add(EngineRequest("long", [rng.randrange(5, 400) for _ in range(60)], four))
    engine.add(EngineRequest("w1", prefix + [1], SamplingParams(max_tokens=1, temperature=0.0)))
    engine.add(EngineRequest("y", [rng.randrange(5, 400) for _ in range(44)], four))
    engine.add(EngineRequest("x", [rng.randrange(5, 400) for _ in range(110)], four))
    engine.add(EngineRequest("w2", prefix + [9, 9, 9], GREEDY))
    engine.check_integrity()
    got, cached = run_until_done(engine, "w2")
    engine.check_integrity()
    assert not engine.scheduler.prefix.queued_hashes and engine.block_manager.num_kept_hashes == 0
    return got, cached, solo


def test_a_waiting_request_keeps_the_prefix_a_request_ahead_of_it_computes(tiny_model_dir):
    # Nothing of w2's prefix is cached when it arrives, so there is nothing to touch; it keeps
    # the hashes w1 (queued ahead) will compute, and they outlast y's younger blocks.
    got, cached, solo = _waiting_on_a_queued_prefix(tiny_model_dir, share=1.0)
    assert got == solo
    assert cached == 64
    got, cached, solo = _waiting_on_a_queued_prefix(tiny_model_dir, share=0.0)
    assert got == solo
    assert cached < 64


def test_published_block_events_keep_the_cached_set_exact_when_a_step_recomputes_an_evicted_block(
    tiny_model_dir,
):
    # A step's scheduling evicts cached blocks; its forward may store the same hashes again (a
    # request whose prefix that eviction cut short recomputes it). The engine reports the
    # evictions before the forward, apart from what the step stores, so a mirror applying
    # each report in order (prefixmesh's KVEventBuffer + net_changes) ends with the block
    # held. Reported together, the removal would win and the mirror would lose the block.
    from replica.server.kv_publisher import net_changes

    rng = random.Random(21)
    p = [rng.randrange(5, 400) for _ in range(64)]  # 4 blocks
    q = [rng.randrange(5, 400) for _ in range(128)]  # 8 blocks
    # Waiting requests only touch their prefix (no keep), so that a step can evict one.
    llm = make_llm(tiny_model_dir, num_kv_blocks=20, max_num_seqs=2, waiting_prefix_share=0)
    engine = llm.engine
    mirror: set[bytes] = set()
    reports: list[tuple[list[bytes], list[bytes]]] = []

    def report(stored, removed):
        reports.append((list(stored), list(removed)))
        added, gone = net_changes([(list(stored), list(removed))])
        mirror.difference_update(gone)
        mirror.update(added)

    engine.set_kv_event_callback(report)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run_greedy(llm, [p + [1]], one)
    run_greedy(llm, [q + [1]], one)  # 12 blocks cached, 8 free
    assert mirror == engine.cached_block_hashes()
    engine.add(EngineRequest("b", [rng.randrange(5, 400) for _ in range(150)], one))  # 10 blocks
    engine.add(EngineRequest("c", p + [9, 9, 9], one))  # p's prefix, marked used on arrival
    engine.add(EngineRequest("d", q + [9], one))  # q's, later: p's blocks are the oldest
    before = len(reports)
    engine.step()  # b takes the 8 free blocks and 2 of p's; c recomputes them
    step_reports = reports[before:]
    removed = {h for _, gone in step_reports for h in gone}
    stored = {h for kept, _ in step_reports for h in kept}
    assert removed & stored, "the step should recompute a block its scheduling evicted"
    assert mirror == engine.cached_block_hashes()
    run_until_done(engine, "d")
    assert mirror == engine.cached_block_hashes()
    engine.check_integrity()


def test_prompt_hashed_once_when_the_record_carries_its_hashes(tiny_model_dir, monkeypatch):
    """The server hashes a prompt's blocks once (for the fetch decision) and passes them in the
    record: the scheduler hashes only the blocks generated after it, and the output and the
    prefix cache are those of a request that came without hashes."""
    import prefixmesh.hashing as hashing
    import replica.prefix_tracker as scheduler_module

    llm = make_llm(tiny_model_dir, block_size=16)
    engine = llm.engine
    ids = random_prompts(1, (70, 70), seed=3)[0]
    want = run_greedy(llm, [ids])[0]
    engine.reset_prefix_cache()
    hashed: list[int] = []  # block indexes the scheduler hashed

    def counting(hashes, token_ids, block_size, model_id, cache_salt=None):
        hashed.extend(range(len(hashes), len(token_ids) // block_size))
        return hashing.extend_block_hashes(hashes, token_ids, block_size, model_id, cache_salt)

    monkeypatch.setattr(scheduler_module, "extend_block_hashes", counting)
    record = EngineRequest("r", ids, GREEDY, cache_salt="s")
    record.block_hashes = engine.prompt_block_hashes(ids, "s")
    assert len(record.block_hashes) == 70 // 16
    engine.add(record)
    got, _ = run_until_done(engine, "r")
    engine.check_integrity()
    assert got == want
    assert hashed and min(hashed) == 70 // 16  # never a prompt block again
    assert set(engine.cached_block_hashes()) >= set(record.block_hashes)
