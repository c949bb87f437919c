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
``PREFIXMESH_ONEDNN=0`` to keep every weight oneDNN would take dense (plain ``F.linear``).

**Batch invariance.** On AMX, oneDNN's bfloat16 (brgemm) matmul blocks its reduction differently for
different row counts M, so row ``i`` of ``linear(x)`` is not always bit for bit row ``i`` of
``linear(x[a:b])``: at SmolLM2's shapes a few elements in 10^4 differ by one bfloat16 ulp once M >
32, and which M do depends on the shape and the thread count. In float32 (every ISA) a single row
takes a matrix-vector path of its own. Every call of 2 to 32 rows (1 to 32 in bfloat16) gives a row
the bits a 32-row call gives it (checked at every M, the row anywhere in the tile). ``linear(...,
invariant=True)`` therefore runs a packed weight over tiles of :data:`INVARIANT_ROWS` rows, a lone
float32 row doubled: a token's result no longer depends on what it was batched with, at the price of
larger matmuls being cut up (docs/benchmarks.md, "Batch-invariant mode"). bfloat16 without AMX
(oneDNN's AVX-512 kernels, or dense ``F.linear`` under AVX2) measured invariant as it is; the tiles
are harmless there.
``tests/test_cpu_linear.py`` checks the property on every ISA the machine runs.

**float32 on FMA vectors.** On a 2-core AVX2 machine (AMD Zen 3) oneDNN's float32 inner product
runs SmolLM2's shapes at 5-50 GFLOP/s from 1 to 16 rows (the weights stream at 7-10 GB/s where
the machine reads ~20) and at 60% of the FMA peak at 64 rows. Our own GEMM on weights packed in
panels of one vector of output features (kernels/csrc/panel_gemm.cpp) runs them 1.4x faster at
64 rows and about 2x at 1-16 (docs/benchmarks.md). ``pack`` packs float32 weights for it where
``PREFIXMESH_F32_GEMM`` (``auto``, the default) finds the AVX2 build, the one it was measured
on; ``panels`` asks for it on any build (AVX-512, or the plain build), ``onednn`` never. It
sums each row in one order whatever the batch, so it too is batch-invariant as it is.

**bfloat16 on AVX-512 BF16 without AMX.** There oneDNN's bfloat16 kernels stream the weights at
15-33 GB/s at decode-sized batches and reach 640-820 GFLOP/s at 64 rows; our own GEMM on the
pair dot product ``vdpbf16ps`` (kernels/csrc/pair_gemm.cpp) runs the same shapes 1.2-1.8x
faster, at ~900 GFLOP/s from 64 rows up (docs/benchmarks.md). ``pack`` packs bfloat16 weights
for it where ``PREFIXMESH_BF16_GEMM`` (``auto``, the default) finds the instruction and no AMX
(oneDNN's AMX kernels run large batches faster than the unit's peak); ``pairs`` asks for it
wherever the shapes allow, emulated in plain C++ where the CPU lacks the instruction;
``emulated`` always emulates it (tests, on any CPU); ``onednn`` never. It sums each row in one
order whatever the batch, so it is batch-invariant as it is.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_flags

BATCH_HINT = 64
# Rows per oneDNN call in batch-invariant mode: calls of 1 to 32 rows all block the same way.
INVARIANT_ROWS = 32


GEMM_ENV = "PREFIXMESH_BF16_GEMM"
GEMM_MODES = ("auto", "pairs", "emulated", "onednn")
F32_GEMM_ENV = "PREFIXMESH_F32_GEMM"
F32_GEMM_MODES = ("auto", "panels", "onednn")
# Kernel builds where ``auto`` packs float32 weights in panels: where it was measured faster.
F32_PANEL_BUILDS = frozenset({"avx2"})


class PairPacked(NamedTuple):
    """A bfloat16 ``[out, in]`` weight packed for the pair-dot-product GEMM."""

    packed: torch.Tensor  # [out / 16, in / 2, 32]
    ops: ModuleType  # the kernels module that multiplies it (kernels/cpu_ops.py)
    emulate: bool  # plain C++ sums: the CPU has no vdpbf16ps


class PanelPacked(NamedTuple):
    """A float32 ``[out, in]`` weight packed in panels for the FMA GEMM."""

    packed: torch.Tensor  # [out / W, in, W], W the build's floats per vector
    ops: ModuleType  # the kernels module that multiplies it (kernels/cpu_ops.py)


def _mode(env: str, modes: tuple[str, ...]) -> str:
    mode = os.environ.get(env, "auto").strip().lower() or "auto"
    if mode not in modes:
        raise ValueError(f"{env} must be one of {', '.join(modes)} (got {mode!r})")
    return mode


def f32_gemm_mode() -> str:
    """``PREFIXMESH_F32_GEMM``: which GEMM float32 weights are packed for (module docstring)."""
    return _mode(F32_GEMM_ENV, F32_GEMM_MODES)


def bf16_gemm_mode() -> str:
    """``PREFIXMESH_BF16_GEMM``: which GEMM bfloat16 weights are packed for (module docstring)."""
    return _mode(GEMM_ENV, GEMM_MODES)


def pack_pairs(weight: torch.Tensor, mode: str | None = None) -> PairPacked | None:
    """``weight`` packed for the pair GEMM when ``mode`` (default: the environment's) asks for
    it here, else ``None``."""
    mode = mode or bf16_gemm_mode()
    n, k = weight.shape
    if (
        mode == "onednn"
        or weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or n % 16
        or k % 2
    ):
        return None
    from kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        return None
    hardware = ops.pairs_hardware() and mode != "emulated"
    if mode == "auto":
        flags = cpu_flags.cpu_flags() or frozenset()
        if not hardware or "avx512_bf16" not in flags or "amx_bf16" in flags:
            return None
    return PairPacked(ops.pack_pairs(weight), ops, emulate=not hardware)


def pack_panels(weight: torch.Tensor, mode: str | None = None) -> PanelPacked | None:
    """``weight`` packed in panels for the float32 GEMM when ``mode`` (default: the
    environment's) asks for it here, else ``None``."""
    mode = mode or f32_gemm_mode()
    if mode == "onednn" or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    from kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None or weight.shape[0] % ops.panel_width():
        return None
    if mode == "auto" and ops.isa().split()[0] not in F32_PANEL_BUILDS:  # "avx2 (8 floats)"
        return None
    return PanelPacked(ops.pack_panels(weight), ops)


def enabled() -> bool:
    return os.environ.get("PREFIXMESH_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor | PairPacked | PanelPacked:
    """``weight`` ([out, in]) packed for the fastest GEMM here that can multiply it: the pair
    GEMM (bfloat16) or the panel GEMM (float32, see the module docstring), oneDNN's layout, or
    as is."""
    own = pack_pairs(weight) or pack_panels(weight)
    return own if own is not None else pack_onednn(weight)


def on_huge_pages(weights: list) -> list:
    """``weights`` (from ``pack``) with the packed tensors of our own GEMMs (``PanelPacked``,
    ``PairPacked``) copied back to back into one region on huge pages
    (``kernels.interface.huge_page_zeros``); anything else (oneDNN's opaque layout, dense
    tensors) stays as it is. The list is updated in place, so each original is freed as soon as
    it is copied when the list held its last reference, and returned.

    A decode step of a few sequences streams every weight from memory once and does little
    arithmetic on it: on 4 KB pages the reads cross a page, and on a VM walk two sets of page
    tables, every 4 KB. On a 2-core Zen 3 VM the 30 layers' GEMMs and the LM head ran
    1.06-1.15x faster at 1 row, 1.05-1.10x at 4 and 1.03-1.09x at 8 from huge pages, and the
    same from 16 rows up, where the arithmetic bounds them (docs/benchmarks.md, "Weights on
    huge pages").
    """
    from kernels.interface import huge_page_zeros

    own = [i for i, w in enumerate(weights) if isinstance(w, (PanelPacked, PairPacked))]
    if not own:
        return weights
    # Each tensor starts on a 4 KB boundary, far more than any dtype's alignment.
    sizes = [-(-weights[i].packed.nbytes // 4096) * 4096 for i in own]
    arena = huge_page_zeros((sum(sizes),), torch.uint8, prefault=False)
    offset = 0
    for i, size in zip(own, sizes):
        packed = weights[i].packed
        copy = arena[offset : offset + packed.nbytes].view(packed.dtype).view(packed.shape)
        weights[i] = weights[i]._replace(packed=copy.copy_(packed))
        offset += size
    return weights


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
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


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PairPacked | PanelPacked,
    bias: torch.Tensor | None = None,
    invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a weight from ``pack`` (packed or not). ``invariant``: each
    row's result bit for bit independent of the other rows (module docstring). ``out``: a
    contiguous ``[rows, out_features]`` tensor of ``x``'s dtype to write the result into (the
    packed kernels write it there directly), returned."""
    if isinstance(weight, PanelPacked):  # invariant as it is
        if x.stride(-1) != 1:
            x = x.contiguous()
        return weight.ops.panels_linear(x, weight.packed, bias, out=out)
    if isinstance(weight, PairPacked):  # invariant as it is
        if x.stride(-1) != 1:
            x = x.contiguous()
        return weight.ops.pairs_linear(x, weight.packed, bias, weight.emulate, out=out)
    if out is not None:
        _check_out(out, (x.shape[0], weight.shape[0]), x)
    result = _unpacked_linear(x, weight, bias, invariant)
    return result if out is None else out.copy_(result)


def _check_out(out: torch.Tensor, shape: tuple[int, int], x: torch.Tensor) -> None:
    """The checks the packed kernels make of ``out`` (kernels/csrc/output.h), with their
    messages, for the paths that copy into it: torch's ``copy_`` would broadcast or cast."""
    if tuple(out.shape) != shape:
        raise RuntimeError(f"linear: out must be {list(shape)}, got {list(out.shape)}")
    if out.dtype != x.dtype or out.device != x.device:
        raise RuntimeError(
            f"linear: out must be {x.dtype} on {x.device}, got {out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise RuntimeError("linear: out must be contiguous")


def _unpacked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool
) -> torch.Tensor:
    if weight.is_mkldnn:
        rows = x.shape[0]
        if not invariant:
            return _onednn(x, weight, bias)
        if rows <= INVARIANT_ROWS:
            return _invariant_tile(x, weight, bias)
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
        for start in range(0, rows, INVARIANT_ROWS):
            end = min(rows, start + INVARIANT_ROWS)
            out[start:end] = _invariant_tile(x[start:end], weight, bias)
        return out
    return F.linear(x, weight, bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _invariant_tile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    # oneDNN multiplies a lone float32 row on a matrix-vector path of its own (different bits
    # from the same row in a 2- to 32-row call); a second copy of the row keeps it on the
    # matrix path. A lone bfloat16 row needs no copy (measured; the test checks it).
    if x.shape[0] == 1 and x.dtype != torch.bfloat16:
        return _onednn(x.repeat(2, 1), weight, bias)[:1]
    return _onednn(x, weight, bias)
