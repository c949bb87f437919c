"""replica/bench.py throughput on the tiny model: what it prints and returns adds up."""

from __future__ import annotations

import json

import pytest

from replica import bench


def test_throughput_bench_reports_both_engines_and_its_phases(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["throughput", "--model", str(tiny_model_dir), "--dtype", "float32",
            "--num-prompts", "4", "--input-len", "24", "--output-len", "6",
            "--hf-batch-size", "2", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32"
    # 4 requests x 6 tokens, on both engines; the ratio is the quotient of the two rates.
    assert abs(result["prefixmesh_output_tok_s"] * result["prefixmesh_s"] - 24) < 1e-6
    assert abs(result["hf_output_tok_s"] * result["hf_s"] - 24) < 1e-6
    ratio = result["prefixmesh_output_tok_s"] / result["hf_output_tok_s"]
    assert abs(result["ratio_vs_hf"] - ratio) < 1e-9
    # The two phases split the run, and the decode phase is output_len - 1 steps.
    phases = result["prefill_phase_s"] + result["decode_phase_s"]
    assert abs(phases - result["prefixmesh_s"]) < 1e-3
    assert abs(result["decode_step_ms"] * 5 / 1000 - result["decode_phase_s"]) < 1e-9
    # The matmul floor splits into its two parts and bounds HF's lead in the same run.
    assert result["floor_prefill_s"] > 0 and result["floor_decode_s"] > 0
    assert result["floor_s"] == result["floor_prefill_s"] + result["floor_decode_s"]
    assert result["floor_ratio_vs_hf"] == result["hf_s"] / result["floor_s"]
    printed = capsys.readouterr().out
    assert "ratio prefixmesh / HF" in printed and "5 decode steps of all 4" in printed
    assert "matmul floor" in printed


def test_matmul_floor_times_every_linear_at_the_workload_shapes(tiny_model_dir, monkeypatch):
    from kernels import cpu_linear
    from replica import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32")
    model = llm.engine.runner.model
    calls: list[tuple[int, int]] = []  # (rows, output width) of every linear call
    real = cpu_linear.linear

    def counting(x, weight, bias=None):
        out = real(x, weight, bias)
        calls.append((x.shape[0], out.shape[-1]))
        return out

    monkeypatch.setattr(cpu_linear, "linear", counting)
    result = bench.matmul_floor(model, prompt_tokens=50, chunk=16, num_seqs=3, output_len=5)
    assert result["floor_s"] == result["floor_prefill_s"] + result["floor_decode_s"] > 0
    layers = len(model.layers)
    vocab = llm.engine.model_config.vocab_size
    # Each shape is run 4 times (a warm-up, then best of 3): prefill in 16-row steps plus a
    # 2-row rest, the LM head once for 3 rows, and one 3-row decode step (timed once, counted
    # output_len - 1 times).
    rows = sorted({r for r, _ in calls})
    assert rows == [2, 3, 16]
    assert sum(1 for r, w in calls if w == vocab) == 4 * 2  # prefill's and decode's LM head
    assert all(r == 3 for r, w in calls if w == vocab)
    per_pass = 4 * layers  # qkv, o, gate_up, down in every layer
    assert sum(1 for r, w in calls if r == 16) == 4 * per_pass
    assert sum(1 for r, w in calls if r == 2) == 4 * per_pass


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("lengths", ["even", "aged"])
def test_attention_bench_compares_the_kernel_with_the_torch_path(
    tmp_path, capsys, dtype, tolerance, lengths
):
    # The dtype is pinned (auto means bfloat16 on some CPUs, float32 on others) and the two
    # paths agree within that dtype's rounding, with even contexts and with aged ones (the
    # oldest sequence 7x the newest's).
    out = tmp_path / "attention.json"
    argv = ["attention", "--batch", "6", "--context", "40", "--iters", "2", "--dtype", dtype,
            "--lengths", lengths, "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["batch"] == 6 and result["dtype"] == dtype and result["lengths"] == lengths
    assert result["max_abs_diff"] < tolerance  # both paths compute the same attention
    assert result["speedup"] == result["torch_sdpa_ms"] / result["cpu_kernel_ms"]
    assert result["kernel_vs_floor"] == result["cpu_kernel_ms"] / result["read_kv_ms"]
    printed = capsys.readouterr().out
    assert "C++ kernel / torch path" in printed and "one read of the" in printed


def test_peak_bench_sets_each_gemm_against_the_peak_of_its_unit(tmp_path, capsys):
    from kernels.cpu_flags import cpu_flags
    from kernels.fma_peak import loop_peak_gflops
    from replica.engine import cpu_has_native_bf16

    out = tmp_path / "peak.json"
    argv = ["peak", "--iters", "1", "--peak-iters", "5000000", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    flags = cpu_flags() or frozenset()
    dtypes = ["float32"] + (["bfloat16"] if cpu_has_native_bf16() else [])
    assert list(result["gemm"]) == dtypes
    for dtype in dtypes:
        assert len(result["gemm"][dtype]) == 9  # 5 shapes at 64 rows, 4 at 1,024 (no LM head)
        assert all(g > 0 for g in result["gemm"][dtype].values())
    peaks = result["peaks"]
    # Each loop unit is measured exactly where the CPU (under any ISA cap) has it.
    assert (peaks["avx512-fma"] is not None) == ("avx512f" in flags)
    assert (peaks["avx512-bf16"] is not None) == ({"avx512f", "avx512_bf16"} <= flags)
    assert (peaks["amx-bf16"] is not None) == ({"amx_tile", "amx_bf16"} <= flags)
    printed = capsys.readouterr().out
    if peaks["avx2-fma"] is None:  # not an x86 CPU with AVX2 + FMA, or no compiler
        assert "not measured here" in printed
        return
    summary = result["float32_summary"]
    # float32 runs on the widest FMA unit the CPU has.
    assert summary["unit"] == ("avx512-fma" if "avx512f" in flags else "avx2-fma")
    for dtype in dtypes:
        summary = result[f"{dtype}_summary"]
        peak = reported = peaks[summary["unit"]]
        best_gemm = max(result["gemm"][dtype].values())
        for _ in range(3):
            if best_gemm < 1.1 * peak:
                break
            # A peak is a maximum: a busy machine can only make a short loop read low, so
            # measure it again, longer, before calling the GEMM faster than its unit.
            peak = max(peak, loop_peak_gflops(summary["unit"], result["threads"], repeats=5))
        # No GEMM beats the unit it runs on (10% for timing noise between the two runs).
        assert best_gemm < 1.1 * peak
        assert summary["share_of_peak"] == summary["gflops"] / reported
        assert f"of the {summary['unit']} peak" in printed


def test_loop_peaks_are_none_where_they_cannot_be_built(tmp_path, monkeypatch):
    from kernels.fma_peak import fma_peak_gflops, loop_peak_gflops

    monkeypatch.setenv("PREFIXMESH_CACHE", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert fma_peak_gflops(1, iters=1000) is None
    assert loop_peak_gflops("avx2-fma", 1, iters=1000) is None


def test_loop_units_follow_the_isa_cap(monkeypatch):
    from kernels.fma_peak import loop_units

    monkeypatch.setenv("PREFIXMESH_CPU_ISA", "generic")
    assert loop_units() == []
    monkeypatch.setenv("PREFIXMESH_CPU_ISA", "avx2")
    assert set(loop_units()) <= {"avx2-fma"}


def test_breakdown_parts_add_up_to_the_step(tiny_model_dir):
    from replica import LLM
    from replica.bench.breakdown import measure_decode_step, start_decoding
    from replica.bench.timing import random_prompts

    llm = LLM(str(tiny_model_dir), dtype="float32")
    engine = llm.engine
    start_decoding(engine, random_prompts(5, 20, 300), max_tokens=12)
    result = measure_decode_step(engine, steps=4)
    assert result["num_seqs"] == 5 and result["steps"] == 4
    parts = ["gemm", "attention", "other", "logits", "sampling", "host"]
    assert all(result[f"{p}_ms"] > 0 for p in parts if p != "other")
    assert abs(sum(result[f"{p}_ms"] for p in parts) - result["step_ms"]) < 1e-6
    assert result["gemm_floor_ms"] > 0 and result["logits_floor_ms"] > 0
    assert result["attention_floor_ms"] is None or result["attention_floor_ms"] > 0
    in_place = result["attention_floor_in_place_ms"]
    assert in_place is None or in_place > 0
    engine.abort_all()
    engine.check_integrity()


def test_measuring_a_step_changes_nothing_the_engine_computes(tiny_model_dir):
    """The timing wrappers and the attention floor's reads in place leave every token as an
    unmeasured run has it (float32, greedy)."""
    from replica import LLM
    from replica.bench.breakdown import engine_steps, measure_decode_step, start_decoding
    from replica.bench.timing import random_prompts
    from replica.sampling_params import SamplingParams

    prompts = random_prompts(4, 20, 300)
    steps = 3
    max_tokens = engine_steps(steps) + 6
    llm = LLM(str(tiny_model_dir), dtype="float32")
    expected = [
        out.outputs[0].token_ids
        for out in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )
    ]
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    real_step = engine.step

    def step():
        deltas = real_step()
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        return deltas

    engine.step = step
    start_decoding(engine, prompts, max_tokens=max_tokens)
    measure_decode_step(engine, steps=steps)
    while engine.has_unfinished_requests():
        engine.step()
    assert [tokens[rid] for rid in sorted(tokens, key=lambda r: int(r.split("-")[1]))] == expected
    engine.check_integrity()


def test_profile_bench_names_our_kernels_in_the_profilers_table(tiny_model_dir, capsys):
    """Our kernels are pybind calls the profiler cannot see by themselves: ``bench profile``
    runs each inside a range named after it while it records, and puts the engine back after."""
    assert bench.main(["profile", "--model", str(tiny_model_dir), "--dtype", "float32",
                       "--num-prompts", "3", "--input-len", "20", "--steps", "2",
                       "--profiled-steps", "2", "--rows", "200"]) == 0  # fmt: skip
    table = capsys.readouterr().out.split("torch.profiler", 1)[1]
    for name in ("linear", "lm_head", "attention"):
        assert f" {name} " in table, name
    from kernels import cpu_ops

    if cpu_ops.load() is not None:
        assert "cpu_ops.add_rms_norm" in table and "cpu_ops.silu_and_mul" in table

    from replica import LLM
    from replica.bench.profile import kernel_ranges

    engine = LLM(str(tiny_model_dir), dtype="float32").engine
    model = engine.runner.model
    linear, ops = model.linear, model.ops
    with kernel_ranges(engine):
        assert model.linear is not linear and "attend" in vars(model.attention)
        if ops is not None:  # the C++ kernels built here: each one gets its own range
            assert model.ops.rms_norm is model.ops.rms_norm  # wrapped once
    assert model.linear is linear and model.ops is ops and "attend" not in vars(model.attention)


def test_prefill_bench_alternates_kernel_rows_and_sdpa(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "prefill.json"
    argv = ["prefill", "--model", str(tiny_model_dir), "--dtype", "float32",
            "--num-prompts", "3", "--input-len", "20", "--long-prompts", "1", "--long-len", "90",
            "--rounds", "2", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    if not result["compared"]:  # no compiler here: the kernel path does not exist
        assert "nothing to compare" in capsys.readouterr().out
        return
    for case in ("short", "long"):
        assert len(result[case]["kernel"]) == len(result[case]["sdpa"]) == 2
        assert all(t > 0 for t in result[case]["kernel"] + result[case]["sdpa"])
    short = result["short"]
    assert short["floor_s"] > 0
    assert short["kernel_vs_floor"] == min(short["kernel"]) / short["floor_s"]
    printed = capsys.readouterr().out
    assert "paged_prefill" in printed and "matmul floor of that prefill" in printed


def test_fetch_bench_fetches_the_prefix_and_reports_the_transfer(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "fetch.json"
    argv = ["fetch", "--model", str(tiny_model_dir), "--dtype", "float32", "--prompt-len", "100",
            "--rounds", "2", "--max-tokens", "6", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["cached_tokens"] == [96, 96] and result["fetched_tokens"] == [96, 96]
    assert result["identical_to_cold"] == [True, True]
    assert result["identical_to_holder_hit"] == [True, True]
    assert result["transfer_mb"] > 0 and result["transfer_mb_per_s"] > 0
    assert "of which fetched [96, 96]" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gemm_bench_times_both_gemms_at_every_row_count_and_the_engine_both_ways(
    tiny_model_dir, tmp_path, capsys, dtype, monkeypatch
):
    from kernels import cpu_linear, cpu_ops

    # The engine of --pages-steps on our own GEMMs on any CPU (the pair GEMM emulated where
    # there is no vdpbf16ps); --engine-rounds and --ahead-steps choose their own.
    monkeypatch.setenv(cpu_linear.F32_GEMM_ENV, "panels")
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "emulated")

    out = tmp_path / "gemm.json"
    argv = ["gemm", "--model", str(tiny_model_dir), "--rows", "1,3", "--layers", "1",
            "--rounds", "1", "--engine-rounds", "1", "--dtype", dtype, "--json", str(out),
            "--ahead-steps", "2", "--pages-steps", "2", "--pages-batches", "1,3"]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    if dtype == "bfloat16":
        own = "pairs"
        assert result["own_path"] == ("pairs" if cpu_ops.load().pairs_hardware() else "emulated")
    else:
        own = "panels"
        assert result["own_path"] == "panels"
    assert [line["rows"] for line in result["gemm"]] == [1, 3]
    size = 2 if dtype == "bfloat16" else 4
    for line in result["gemm"]:
        assert line["onednn"]["ms"] > 0 and line[own]["ms"] > 0
        assert line["speedup"] == line["onednn"]["ms"] / line[own]["ms"]
        # Rates from the same milliseconds: GFLOP/s = 2 x rows x elements, GB/s = size x elements.
        assert abs(line[own]["gflops"] / line[own]["gb_s"] - 2 * line["rows"] / size) < 1e-6
    # One round of the engine per GEMM, both workloads measured.
    assert [row["gemm"] for row in result["engine"]] == ["onednn", result["own_path"]]
    assert all(row["throughput_tok_s"] > 0 and row["varied_tok_s"] > 0 for row in result["engine"])
    printed = capsys.readouterr().out
    assert ("pair GEMM: " if dtype == "bfloat16" else "panel GEMM, build") in printed
    assert "speed-up" in printed
    if dtype == "float32":  # the panel GEMM asking ahead and not, on the same weights
        for line in result["gemm"]:
            assert line["panels_not_ahead"]["ms"] > 0
            assert line["ahead_speedup"] == line["panels_not_ahead"]["ms"] / line[own]["ms"]
        steps = result["ahead_steps"]
        assert steps["pairs"] == 2 and len(steps["ahead_ms"]) == len(steps["not_ahead_ms"]) == 2
        assert "ahead saves" in printed and "pairs of decode steps" in printed
        assert cpu_ops.load().set_panel_ahead(True) is True  # left on
    else:
        assert "ahead_steps" not in result and "panels_not_ahead" not in result["gemm"][0]
    # Our GEMM's weights on huge pages (the default) against the same on 4 KB pages.
    for line in result["gemm"]:
        assert line["huge_pages_speedup"] == line["own_small_pages"]["ms"] / line[own]["ms"]
    assert "huge saves" in printed
    # ... and in the engine, whose weights the environment put on our own GEMM (above).
    assert [row["batch"] for row in result["pages_steps"]] == [1, 3]
    for row in result["pages_steps"]:
        assert len(row["huge_ms"]) == len(row["small_ms"]) == 2
        assert all(ms > 0 for ms in row["huge_ms"] + row["small_ms"])
    assert "on huge pages" in printed and "on 4 KB pages" in printed


def test_gpu_bench_checks_parity_on_new_weights_and_times_each_backend(
    tiny_model_dir, tmp_path, capsys
):
    # Without CUDA it runs on the CPU: the torch backend here (the Triton one would run under
    # the interpreter, minutes); kernels/gpu_check.sh runs both on a GPU.
    out = tmp_path / "gpu.json"
    argv = ["gpu", "--model", str(tiny_model_dir), "--random-weights", "--layers", "1",
            "--dtype", "float32", "--backends", "torch", "--batch", "4", "--prompt-len", "20",
            "--max-tokens", "5", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    torch_rounds = result["parity"]["torch"]
    assert torch_rounds["equal"] == [[True] * 4, [True] * 4] and result["parity_passed"]
    # The second round finds every prompt's full blocks of the first (the last token never).
    assert torch_rounds["cached_tokens"][1] == [64, 96, 208, 0]
    assert result["throughput"]["torch"]["tokens"] == 4 * 5
    assert "parity: PASS" in capsys.readouterr().out
