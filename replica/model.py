"""Our own Llama-family decoder (SmolLM2, Llama, Qwen2-style q/k/v bias, Mistral) on a paged
KV cache.

One forward runs a packed batch of new tokens from many sequences (prefill chunks and decodes
mixed); attention reads and writes the paged cache through an ``AttentionBackend``. Weights use
Hugging Face's parameter names; q/k/v and gate/up projections are fused at load time so each
layer does three large matmuls instead of seven small ones (Python overhead per op is what limits
a small model on a CPU). On a CPU the matmul weights are packed once for oneDNN
(kernels/cpu_linear.py), and the work between the matmuls runs as four fused C++ kernels per
layer (kernels/cpu_ops.py): RMSNorm with its residual add, RoPE with the KV-cache write, SiLU
with its multiply, and paged decode attention. Elsewhere (GPUs, or no compiler) the same maths
runs as torch ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import cpu_linear, cpu_ops
from kernels.cpu_linear import pack
from kernels.interface import AttentionBackend, AttentionMetadata, weight_huge_pages
from replica.model_config import ModelConfig, rope_inv_freq

# Each layer's matmul weights, packed by ``pack`` (kernels/cpu_linear.py).
GEMM_WEIGHTS = ("qkv", "o", "gate_up", "down")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Inference-only Llama decoder holding fused weights as plain tensors."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        batch_invariant: bool = False,
    ) -> None:
        """``batch_invariant``: every matmul gives a token the same bits whatever it is batched
        with (kernels/cpu_linear.py), so a prefix-cache hit reproduces a cold run exactly."""
        self.config = config
        self.linear = functools.partial(cpu_linear.linear, invariant=batch_invariant)
        self.attention = attention
        self.dtype = dtype
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        lm_head = weights.pop("lm_head.weight", None)
        if lm_head is None or c.tie_word_embeddings:
            self.lm_head = pack(self.embed)
        else:
            self.lm_head = pack(lm_head.to(device=device, dtype=dtype).contiguous())
        self.norm = take("model.norm.weight")
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            qkv_bias = None
            if c.attention_bias:
                qkv_bias = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            self.layers.append(
                {
                    "input_norm": take(p + "input_layernorm.weight"),
                    "qkv": pack(qkv),
                    "qkv_bias": qkv_bias,
                    "o": pack(take(p + "self_attn.o_proj.weight")),
                    "post_norm": take(p + "post_attention_layernorm.weight"),
                    "gate_up": pack(gate_up),
                    "down": pack(take(p + "mlp.down_proj.weight")),
                }
            )
        if weight_huge_pages():
            self._weights_on_huge_pages()
        # cos/sin tables for every position, computed in float32 as Hugging Face does.
        inv_freq = rope_inv_freq(c).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        # The fused CPU kernels: None on other devices, where no compiler is available, or
        # with PREFIXMESH_CPU_KERNELS=0. They take the half tables, in float32.
        fusable = device.type == "cpu" and attention.name == "torch"
        self.ops = cpu_ops.load() if fusable else None
        self.cos_half = freqs.cos().contiguous()
        self.sin_half = freqs.sin().contiguous()

    def gemm_weights(self) -> list:
        """Every layer's packed matmul weights (in ``GEMM_WEIGHTS`` order), then the LM head."""
        return [layer[name] for layer in self.layers for name in GEMM_WEIGHTS] + [self.lm_head]

    def set_gemm_weights(self, weights: list) -> None:
        """Puts ``weights``, listed as ``gemm_weights`` lists them, in their places."""
        given = iter(weights)
        for layer in self.layers:
            for name in GEMM_WEIGHTS:
                layer[name] = next(given)
        self.lm_head = next(given)

    def _weights_on_huge_pages(self) -> None:
        """The matmuls' packed weights moved onto huge pages (``cpu_linear.on_huge_pages``).
        The model lets go of them first, so that each original is freed once copied."""
        weights = self.gemm_weights()
        self.set_gemm_weights([None] * len(weights))
        self.set_gemm_weights(cpu_linear.on_huge_pages(weights))

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Normalize in float32, cast back, then scale: Hugging Face's order (bit for bit in
        # float32), with torch's fused kernel for the normalization itself.
        eps = self.config.rms_norm_eps
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,  # rows of the packed batch whose next token is sampled
    ) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` in the model's dtype, after writing the batch's
        KV. Not widened to float32 here: the sampler's argmax reads bfloat16 exactly, and it
        widens only the rows it samples or takes logprobs of (a decode step's [64, 49152]
        widening alone cost about 1 ms)."""
        if self.ops is not None:
            return self._forward_fused(input_ids, positions, meta, kv_caches, logits_indices)
        c, linear = self.config, self.linear
        num_tokens = input_ids.shape[0]
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        hidden = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            residual = hidden
            x = self._rms_norm(hidden, layer["input_norm"])
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(num_tokens, c.num_heads, c.head_dim)
            k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
            v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = self.attention.attend(q, k_cache, v_cache, meta, self.scale)
            hidden = residual + linear(attn.reshape(num_tokens, self.q_size), layer["o"])
            residual = hidden
            x = self._rms_norm(hidden, layer["post_norm"])
            gate, up = linear(x, layer["gate_up"]).chunk(2, dim=-1)
            hidden = residual + linear(F.silu(gate) * up, layer["down"])
        hidden = self._rms_norm(hidden[logits_indices], self.norm)
        return linear(hidden, self.lm_head)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` with the fused CPU kernels: per layer four matmuls and four kernels.

        ``residual`` carries the skip connection: ``add_rms_norm`` adds each sublayer's output
        to it in place and normalizes the sum, as Hugging Face's decoder layer does in two.
        Every layer writes its intermediates into the same buffers (``_Buffers``).
        """
        c, ops, linear = self.config, self.ops, self.linear
        eps = c.rms_norm_eps
        residual = F.embedding(input_ids, self.embed)
        x = ops.rms_norm(residual, self.layers[0]["input_norm"], eps)
        out = residual
        buf = _Buffers(self, input_ids.shape[0], residual)
        wants_kv = self.attention.wants_new_kv  # the C++ kernels read the cache instead
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            qkv = linear(x, layer["qkv"], layer["qkv_bias"], out=buf.qkv)
            ops.rope_write_kv(
                qkv, positions, self.cos_half, self.sin_half, c.num_heads, c.num_kv_heads,
                k_cache, v_cache, meta.slot_mapping,
            )  # fmt: skip
            if wants_kv:
                self.attention.kv_written(buf.k, buf.v)
            self.attention.attend(buf.q, k_cache, v_cache, meta, self.scale, out=buf.attn)
            o = linear(buf.attn_rows, layer["o"], out=buf.o)
            x = ops.add_rms_norm(o, residual, layer["post_norm"], eps, out=buf.x)
            gate_up = linear(x, layer["gate_up"], out=buf.gate_up)
            out = linear(ops.silu_and_mul(gate_up, out=buf.act), layer["down"], out=buf.down)
            if i + 1 < len(self.layers):
                x = ops.add_rms_norm(
                    out, residual, self.layers[i + 1]["input_norm"], eps, out=buf.x
                )
        rows = residual[logits_indices]  # a copy: only the sampled rows reach the LM head
        hidden = ops.add_rms_norm(out[logits_indices], rows, self.norm, eps)
        return linear(hidden, self.lm_head)


class _Buffers:
    """One forward pass's intermediates, which every layer writes in turn: each is read before
    the next layer writes it again. A decode step then allocates seven tensors, not eight a
    layer, and makes the views of the queries and keys once (docs/kernels.md, "Output
    buffers")."""

    def __init__(self, model: LlamaModel, num_tokens: int, like: torch.Tensor) -> None:
        c, T = model.config, num_tokens

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=like.dtype, device=like.device)

        q_end, k_end = model.q_size, model.q_size + model.kv_size
        self.qkv = empty(T, k_end + model.kv_size)
        self.q = self.qkv[:, :q_end].view(T, c.num_heads, c.head_dim)
        self.k = self.qkv[:, q_end:k_end].view(T, c.num_kv_heads, c.head_dim)
        self.v = self.qkv[:, k_end:].view(T, c.num_kv_heads, c.head_dim)
        self.attn = empty(T, c.num_heads, c.head_dim)
        self.attn_rows = self.attn.view(T, model.q_size)
        self.o, self.x, self.down = (empty(T, c.hidden_size) for _ in range(3))
        self.gate_up = empty(T, 2 * c.intermediate_size)
        self.act = empty(T, c.intermediate_size)
