"""kernels/cpu_linear.py: oneDNN-packed weights multiply like F.linear, or fall back to it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import pair_modes, run_under_cap

from kernels import cpu_flags, cpu_linear

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_matches_f_linear(dtype, with_bias, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(40, 96, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if with_bias else None
    packed = cpu_linear.pack(w)
    got = cpu_linear.linear(x, packed, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_float32_weights_are_packed_where_onednn_is_available(monkeypatch):
    monkeypatch.setenv(cpu_linear.F32_GEMM_ENV, "onednn")
    w = torch.randn(8, 16)
    assert cpu_linear.pack(w).is_mkldnn == torch.backends.mkldnn.is_available()


def test_disabled_by_environment_keeps_weights_dense(monkeypatch):
    monkeypatch.setenv("PREFIXMESH_ONEDNN", "0")
    monkeypatch.setenv(cpu_linear.F32_GEMM_ENV, "onednn")  # not the panel GEMM either
    w = torch.randn(8, 16)
    assert cpu_linear.pack(w) is w
    x = torch.randn(3, 16)
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w))


def test_unsupported_dtype_falls_back_to_dense(monkeypatch):
    monkeypatch.setenv(cpu_linear.F32_GEMM_ENV, "onednn")

    def no_kernel(*args):
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", no_kernel)
    w = torch.randn(8, 16)
    assert cpu_linear.pack(w) is w


# SmolLM2's matmuls ([out, in]: qkv, o, gate_up, down) and rows cut the way the issue-17 case
# cuts a 1,516-token prompt: the prefix computed in a 1,500-token step, the suffix in a 28-token
# one, a cold run in one step or in 1,024-token chunks, a decode row alone.
_INVARIANCE = textwrap.dedent(
    """
    import json, sys
    import torch
    from kernels import cpu_flags, cpu_linear

    dtype = getattr(torch, sys.argv[1])
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    slices = [(0, 1500), (1488, 1516), (0, 1024), (1024, 1516), (1515, 1516), (3, 40), (40, 104)]
    gen = torch.Generator().manual_seed(0)
    broken, plain_broken = [], 0
    for n, k in shapes:
        weight = cpu_linear.pack((torch.randn(n, k, generator=gen) * 0.05).to(dtype))
        x = torch.randn(1516, k, generator=gen).to(dtype)
        full = cpu_linear.linear(x, weight, invariant=True)
        plain = cpu_linear.linear(x, weight)
        for a, b in slices:
            if not torch.equal(cpu_linear.linear(x[a:b], weight, invariant=True), full[a:b]):
                broken.append([n, k, a, b])
            plain_broken += int((cpu_linear.linear(x[a:b], weight) != plain[a:b]).sum())
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a holder and an asker may run different thread counts
        if not torch.equal(cpu_linear.linear(x, weight, invariant=True), full):
            broken.append([n, k, "1 thread"])
        torch.set_num_threads(threads)
    print("RESULT" + json.dumps({"isa": cpu_flags.cpu_isa(), "broken": broken,
                                 "plain_broken": plain_broken}))
    """
)


@pytest.mark.parametrize("cap", cpu_flags.supported_isas())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_linear_gives_a_row_the_same_bits_in_any_batch(cap, dtype):
    """The batch-invariant mode's contract (docs/fetch.md): a row's result is bit for bit the
    same whatever rows it is multiplied with. On AMX, oneDNN's plain bfloat16 matmul breaks it
    (a few elements per 10^4 once a call has more than 32 rows), which made a bfloat16
    prefix-cache hit pick other tokens than a cold run. A fresh process per cap, with oneDNN
    and ATen capped too, so every kind of CPU the project runs on is checked here."""
    result = run_under_cap(_INVARIANCE, [dtype], cap, ROOT)
    assert result["isa"] == cap
    assert result["broken"] == []
    print(f"{cap} {dtype}: plain oneDNN matmul, elements differing by batch: "
          f"{result['plain_broken']}")  # fmt: skip


# --------------------------------------------------------------------------- the pair GEMM
# kernels/csrc/pair_gemm.cpp: bfloat16 weights packed for vdpbf16ps. The emulated path runs on
# every CPU; the instruction's path wherever this build and CPU have it.
PAIR_MODES = pair_modes()


def _pairs(weight: torch.Tensor, mode: str) -> cpu_linear.PairPacked:
    packed = cpu_linear.pack_pairs(weight, mode)
    assert isinstance(packed, cpu_linear.PairPacked)
    assert packed.emulate == (mode == "emulated")
    return packed


@pytest.mark.parametrize("mode", PAIR_MODES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 13, 64])
# 1, 2, 3 and 5 blocks of 16 features: items of 1, 2 and 3 blocks; in features from one pair up.
@pytest.mark.parametrize("out_in", [(16, 2), (32, 96), (48, 96), (80, 34), (960, 576)])
def test_pair_gemm_matches_the_float64_product(mode, with_bias, rows, out_in):
    n, k = out_in
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    got = cpu_linear.linear(x, _pairs(w, mode), b)
    want = x.double() @ w.double().t() + (b.double() if with_bias else 0)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # One rounding to bfloat16 (2^-8 relative) on top of float32 sums.
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3 * (k**0.5))


def _same_bits_in_any_batch_and_thread_count(x: torch.Tensor, packed) -> None:
    full = cpu_linear.linear(x, packed)
    for a, b in [(0, 1), (3, 8), (10, 16), (3, 11), (9, 70), (69, 70), (0, 64)]:
        assert torch.equal(cpu_linear.linear(x[a:b], packed), full[a:b]), (a, b)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(cpu_linear.linear(x, packed), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", PAIR_MODES)
def test_pair_gemm_gives_a_row_the_same_bits_in_any_batch_and_thread_count(mode):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 576, generator=gen).bfloat16()
    packed = _pairs((torch.randn(960, 576, generator=gen) * 0.05).bfloat16(), mode)
    _same_bits_in_any_batch_and_thread_count(x, packed)


@pytest.mark.skipif("pairs" not in PAIR_MODES, reason="this build or CPU has no vdpbf16ps")
def test_hardware_pairs_agree_with_the_emulation():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(21, 1536, generator=gen).bfloat16()
    w = (torch.randn(576, 1536, generator=gen) * 0.05).bfloat16()
    hw = cpu_linear.linear(x, _pairs(w, "pairs")).float()
    emulated = cpu_linear.linear(x, _pairs(w, "emulated")).float()
    # The same sums up to float32 rounding: at most one bfloat16 step apart.
    torch.testing.assert_close(hw, emulated, rtol=2**-7, atol=1e-4)


def test_pair_gemm_strided_rows_and_empty_batches():
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(32, 64, generator=gen) * 0.1).bfloat16()
    packed = _pairs(w, "emulated")
    wide = torch.randn(5, 100, generator=gen).bfloat16()
    x = wide[:, 10:74]  # rows 100 apart
    torch.testing.assert_close(
        cpu_linear.linear(x, packed), cpu_linear.linear(x.contiguous(), packed), rtol=0, atol=0
    )
    assert cpu_linear.linear(x[:0], packed).shape == (0, 32)


def test_pack_pairs_takes_only_what_it_can_multiply():
    bf = torch.randn(32, 64).bfloat16()
    assert cpu_linear.pack_pairs(bf.float(), "pairs") is None  # float32: oneDNN's
    assert cpu_linear.pack_pairs(torch.randn(40, 64).bfloat16(), "pairs") is None  # 40 % 16
    assert cpu_linear.pack_pairs(torch.randn(32, 63).bfloat16(), "pairs") is None  # odd inputs
    assert cpu_linear.pack_pairs(bf, "onednn") is None
    from kernels import cpu_ops

    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_ops.load().pack_pairs(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        cpu_ops.load().pairs_linear(torch.randn(2, 32).bfloat16(), _pairs(bf, "emulated").packed)


class _FakeOps:
    def __init__(self, hardware: bool) -> None:
        self.hardware = hardware

    def pairs_hardware(self) -> bool:
        return self.hardware

    def pack_pairs(self, weight):
        return weight


@pytest.mark.parametrize(
    ("flags", "hardware", "mode", "expected"),
    [
        ({"avx512f", "avx512_bf16"}, True, "auto", "hardware"),  # Zen 4/5, Cooper Lake
        ({"avx512f", "avx512_bf16", "amx_bf16"}, True, "auto", None),  # AMX: oneDNN's tiles
        ({"avx512f"}, True, "auto", None),  # no bf16 dot products
        ({"avx512f", "avx512_bf16"}, False, "auto", None),  # a build without the path
        ({"avx2"}, False, "pairs", "emulated"),
        ({"avx512f", "avx512_bf16"}, True, "emulated", "emulated"),
        ({"avx512f", "avx512_bf16"}, True, "onednn", None),
    ],
)
def test_bf16_gemm_choice(monkeypatch, flags, hardware, mode, expected):
    from kernels import cpu_ops

    monkeypatch.setattr(cpu_flags, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_ops, "load", lambda: _FakeOps(hardware))
    monkeypatch.setenv(cpu_linear.GEMM_ENV, mode)
    got = cpu_linear.pack_pairs(torch.zeros(32, 64, dtype=torch.bfloat16))
    assert (None if got is None else ("emulated" if got.emulate else "hardware")) == expected


def test_bf16_gemm_mode_names_the_allowed_values(monkeypatch):
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="auto, pairs, emulated, onednn"):
        cpu_linear.bf16_gemm_mode()


# --------------------------------------------------------------------------- the panel GEMM
# kernels/csrc/panel_gemm.cpp: float32 weights packed in panels of one vector of features. Every
# kernel build this machine runs (the plain one included) is tested in this process.
def _panel_builds() -> list:
    from kernels import cpu_ops

    builds = [cpu_ops.build_isa(cap) for cap in cpu_flags.supported_isas()]
    return sorted(set(builds)) if cpu_ops.load() is not None else []


PANEL_BUILDS = _panel_builds()


def _panels(weight: torch.Tensor, build: str) -> cpu_linear.PanelPacked:
    from kernels import cpu_ops

    ops = cpu_ops.load(build)
    return cpu_linear.PanelPacked(ops.pack_panels(weight), ops)


@pytest.mark.parametrize("build", PANEL_BUILDS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 8, 9, 13, 64])
# Items of 1, 2 and 3 blocks (5 blocks: items of one), and SmolLM2's qkv; 5 and 6 rows in one
# pass where the blocks pair up (AVX2).
@pytest.mark.parametrize("blocks_in", [(1, 3), (2, 96), (3, 96), (5, 34), (0, 576)])
def test_panel_gemm_matches_the_float64_product(build, with_bias, rows, blocks_in):
    from kernels import cpu_ops

    blocks, k = blocks_in
    n = blocks * cpu_ops.load(build).panel_width() if blocks else 960
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.1
    b = torch.randn(n, generator=gen) if with_bias else None
    got = cpu_linear.linear(x, _panels(w, build), b)
    want = x.double() @ w.double().t() + (b.double() if with_bias else 0)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("build", PANEL_BUILDS)
def test_panel_gemm_gives_a_row_the_same_bits_in_any_batch_and_thread_count(build):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 576, generator=gen)
    packed = _panels(torch.randn(960, 576, generator=gen) * 0.05, build)
    _same_bits_in_any_batch_and_thread_count(x, packed)


@pytest.mark.parametrize("build", PANEL_BUILDS)
@pytest.mark.parametrize("rows", [8, 12, 16, 70, 1030])
def test_panel_gemm_asking_for_panels_ahead_changes_no_bit(build, rows):
    """From 12 rows up an item asks for its thread's next panels while it computes
    (kernels/csrc/panel_gemm.cpp); prefetches change no result, and the switch is remembered."""
    from kernels import cpu_ops

    ops = cpu_ops.load(build)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    w = torch.randn(960, 576, generator=gen) * 0.05
    packed = ops.pack_panels(w)
    ahead = ops.panels_linear(x, packed)
    assert ops.set_panel_ahead(False) is True
    try:
        plain = ops.panels_linear(x, packed)
    finally:
        assert ops.set_panel_ahead(True) is False
    assert torch.equal(ahead, plain)
    want = x.double() @ w.double().t()
    torch.testing.assert_close(ahead.double(), want, rtol=1e-5, atol=1e-5 * 576**0.5)


@pytest.mark.parametrize("build", PANEL_BUILDS)
def test_panel_gemm_strided_rows_and_empty_batches(build):
    gen = torch.Generator().manual_seed(9)
    packed = _panels(torch.randn(48, 64, generator=gen), build)
    x = torch.randn(5, 100, generator=gen)[:, 10:74]  # rows 100 apart
    assert torch.equal(cpu_linear.linear(x, packed), cpu_linear.linear(x.contiguous(), packed))
    assert cpu_linear.linear(x[:0], packed).shape == (0, 48)


@pytest.mark.skipif(not PANEL_BUILDS, reason="the C++ kernels do not build here")
def test_pack_panels_takes_only_what_it_can_multiply():
    from kernels import cpu_ops

    ops = cpu_ops.load()
    width = ops.panel_width()
    assert cpu_linear.pack_panels(torch.randn(48, 64).bfloat16(), "panels") is None
    assert cpu_linear.pack_panels(torch.randn(width + 1, 64), "panels") is None
    assert cpu_linear.pack_panels(torch.randn(48, 64), "onednn") is None
    assert isinstance(cpu_linear.pack_panels(torch.randn(48, 64), "panels"), cpu_linear.PanelPacked)
    with pytest.raises(RuntimeError, match=f"multiple of {width}"):
        ops.pack_panels(torch.randn(width + 1, 64))
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        ops.panels_linear(torch.randn(2, 32), ops.pack_panels(torch.randn(48, 64)))


@pytest.mark.skipif(not PANEL_BUILDS, reason="the C++ kernels do not build here")
@pytest.mark.parametrize(
    ("build", "mode", "panels"),
    [
        ("avx2", "auto", True),  # measured faster there (docs/benchmarks.md)
        ("avx512", "auto", False),  # not measured yet: oneDNN
        ("generic", "auto", False),
        ("generic", "panels", True),
        ("avx2", "onednn", False),
    ],
)
def test_f32_gemm_choice(monkeypatch, build, mode, panels):
    from kernels import cpu_ops

    class Build:  # the kernels module as each build names itself; packs as this machine's
        def __init__(self, real) -> None:
            self.real = real

        def isa(self) -> str:
            return f"{build} (8 floats)"

        def __getattr__(self, name):
            return getattr(self.real, name)

    real = cpu_ops.load()
    monkeypatch.setattr(cpu_ops, "load", lambda isa=None: Build(real))
    monkeypatch.setenv(cpu_linear.F32_GEMM_ENV, mode)
    got = cpu_linear.pack(torch.randn(48, 64))
    assert isinstance(got, cpu_linear.PanelPacked) == panels


def test_f32_gemm_mode_names_the_allowed_values(monkeypatch):
    monkeypatch.setenv(cpu_linear.F32_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="auto, panels, onednn"):
        cpu_linear.f32_gemm_mode()


def _weights_of_every_kind() -> list[tuple[str, object, torch.dtype]]:
    """A [48, 64] weight as each GEMM here multiplies it: the pair GEMM (emulated, any CPU), the
    panel GEMM (where its build loads), oneDNN's layout (where torch has oneDNN) and as is
    (F.linear): the last two compute a new tensor and copy it into ``out``."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(48, 64, generator=gen) * 0.1
    kinds = [("pairs", _pairs(w.bfloat16(), "emulated"), torch.bfloat16)]
    kinds += [(f"panels-{b}", _panels(w, b), torch.float32) for b in PANEL_BUILDS]
    kinds += [("onednn", cpu_linear.pack_onednn(w), torch.float32)]
    return kinds + [("unpacked", w, torch.float32)]


def test_linear_writes_into_a_given_buffer_and_refuses_a_wrong_one():
    """``out=``: the same bits as a new tensor, in the caller's buffer (the model reuses one a
    forward pass, kernels/csrc/output.h); a buffer of the wrong shape, dtype or layout is
    refused with the same message on every path, the copying ones (oneDNN, F.linear) too."""
    gen = torch.Generator().manual_seed(12)
    for name, weight, dtype in _weights_of_every_kind():
        x = torch.randn(9, 64, generator=gen).to(dtype)
        bias = torch.randn(48, generator=gen).to(dtype)
        want = cpu_linear.linear(x, weight, bias)
        buffer = torch.full((9, 48), float("nan"), dtype=dtype)
        got = cpu_linear.linear(x, weight, bias, out=buffer)
        assert got.data_ptr() == buffer.data_ptr(), name
        assert torch.equal(buffer, want), name
        with pytest.raises(RuntimeError, match=r"out must be \[9, 48\]"):
            cpu_linear.linear(x, weight, out=torch.empty(9, 47, dtype=dtype))
        wrong = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        with pytest.raises(RuntimeError, match="out must be"):
            cpu_linear.linear(x, weight, out=torch.empty(9, 48, dtype=wrong))
        with pytest.raises(RuntimeError, match="out must be contiguous"):
            cpu_linear.linear(x, weight, out=torch.empty(48, 9, dtype=dtype).t())
        # A [48] buffer would take a [1, 48] result by broadcasting in torch's copy_.
        with pytest.raises(RuntimeError, match=r"out must be \[1, 48\]"):
            cpu_linear.linear(x[:1], weight, out=torch.empty(48, dtype=dtype))
