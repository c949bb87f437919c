"""The model shape the engine needs, read from a Hugging Face ``config.json``.

Supports the Llama family as Hugging Face writes it (``llama``, ``mistral``, ``qwen2``), in both
the transformers 4.x layout (``rope_theta`` + ``rope_scaling``) and the 5.x layout
(``rope_parameters``). RoPE frequencies, including Llama-3 and linear scaling, come from
:func:`rope_inv_freq` so every attention path uses the same numbers as transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixmesh.tokenizer import as_token_ids

if TYPE_CHECKING:
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture hyperparameters of a Llama-style decoder-only model."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else a dict with "rope_type" ("linear" or "llama3") and its factors.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    model_type: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a ``config.json`` dict (and optionally ``generation_config.json``'s).

        Raises ``ValueError`` naming the field for unsupported or inconsistent configs.
        """
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        rope_theta, rope_scaling = _rope_fields(config)
        # Qwen2 has q/k/v biases but its config.json does not say so.
        attention_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))
        sliding_window = config.get("sliding_window")
        if model_type == "qwen2" and not config.get("use_sliding_window", False):
            sliding_window = None
        eos = as_token_ids(config.get("eos_token_id"))
        if generation_config:
            eos += [i for i in as_token_ids(generation_config.get("eos_token_id")) if i not in eos]
        bos = config.get("bos_token_id")
        if bos is None and generation_config:
            bos = generation_config.get("bos_token_id")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
            model_type=model_type,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        )


def _rope_fields(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the 4.x or the 5.x config layout."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or None
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type {rope_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "default":
            return float(theta), None
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        scaling.pop("rope_theta", None)
    return float(theta), scaling


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] (float32), scaled exactly as transformers does."""
    import torch

    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # "llama3": keep high frequencies, divide low ones by factor, blend in between.
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
