"""replica/bench.py throughput on the tiny model: what it prints and returns adds up."""

from __future__ import annotations

import json

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


def test_attention_bench_compares_the_kernel_with_the_torch_path(tmp_path, capsys):
    out = tmp_path / "attention.json"
    argv = ["attention", "--batch", "6", "--context", "40", "--iters", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["batch"] == 6
    assert result["max_abs_diff"] < 1e-4  # both paths compute the same attention
    assert result["speedup"] == result["torch_sdpa_ms"] / result["cpu_kernel_ms"]
    assert "C++ kernel / torch path" in capsys.readouterr().out


def test_peak_bench_sets_the_gemm_against_the_fma_peak(tmp_path, capsys):
    out = tmp_path / "peak.json"
    argv = ["peak", "--iters", "1", "--peak-iters", "5000000", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["gemm"]) == 9  # 5 shapes at 64 rows, 4 at 1,024 (no LM head)
    assert all(g > 0 for g in result["gemm"].values()) and result["gemm_gflops"] > 0
    printed = capsys.readouterr().out
    if result["fma_peak_gflops"] is None:  # not an x86 CPU with AVX2 + FMA
        assert "not measured here" in printed
    else:
        # No GEMM beats the FMA units it runs on.
        assert result["gemm_gflops"] < result["fma_peak_gflops"]
        assert result["gemm_share_of_peak"] == result["gemm_gflops"] / result["fma_peak_gflops"]
        assert "of the FMA peak" in printed


def test_fma_peak_is_none_where_it_cannot_be_built(tmp_path, monkeypatch):
    from kernels.fma_peak import fma_peak_gflops

    monkeypatch.setenv("PREFIXMESH_CACHE", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert fma_peak_gflops(1, iters=1000) is None
