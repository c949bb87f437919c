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
    printed = capsys.readouterr().out
    assert "ratio prefixmesh / HF" in printed and "5 decode steps of all 4" in printed


def test_attention_bench_compares_the_kernel_with_the_torch_path(tmp_path, capsys):
    out = tmp_path / "attention.json"
    argv = ["attention", "--batch", "6", "--context", "40", "--iters", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["batch"] == 6
    assert result["max_abs_diff"] < 1e-4  # both paths compute the same attention
    assert result["speedup"] == result["torch_sdpa_ms"] / result["cpu_kernel_ms"]
    assert "C++ kernel / torch path" in capsys.readouterr().out
