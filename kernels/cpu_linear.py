"""Linear layers on the CPU through oneDNN with weights packed once at load time.

``F.linear`` on a CPU calls MKL's sgemm, which re-lays out the weight on every call and, on AMD
CPUs, does not take its best path: at SmolLM2's shapes it runs at 35-90 GFLOP/s on a 2-core
AVX2 machine. oneDNN's inner product on a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) runs the same shapes at 70-125 GFLOP/s, the LM
head at M=64 twice as fast, and the engine end to end 21-25% faster in float32
(docs/benchmarks.md). Torch's own CPU compiler (inductor) packs and multiplies with the same
two ops, for the same reason.

``pack`` returns the weight unchanged where oneDNN cannot run it (not a CPU tensor, a dtype
this CPU's oneDNN has no kernel for, such as bfloat16 without AVX-512, or a torch without these
private ops) and ``linear`` then falls back to ``F.linear``, so callers never branch. Set
``PREFIXMESH_ONEDNN=0`` to keep every weight dense (plain ``F.linear``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

BATCH_HINT = 64


def enabled() -> bool:
    return os.environ.get("PREFIXMESH_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in]) in oneDNN's layout when oneDNN can multiply it here, else as is."""
    if weight.device.type != "cpu" or not enabled():
        return weight
    try:
        # Reordered into the blocked layout oneDNN picks for a batch of ``BATCH_HINT`` rows; it
        # serves every batch size (measured: as fast or faster than the plain layout from 1 to
        # 1,024 rows, 10-35% faster at decode-sized batches).
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # no oneDNN kernel for this dtype / no such op
        return weight
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a weight from ``pack`` (packed or not)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
