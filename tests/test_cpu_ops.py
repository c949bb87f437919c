"""The C++ CPU kernels (kernels/cpu_ops.py) against torch references, under every ISA build this
machine can run, and the ISA cap (``PREFIXMESH_CPU_ISA``) that lets one machine run them all.

An AVX2 machine runs the ``generic`` and ``avx2`` builds; an AVX-512 or AMX machine runs the
``avx512`` one as well. Builds this CPU cannot run are still compiled (syntax only), so a change
that breaks another machine's build fails here too.
"""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_under_cap
from test_kernels import Case, check_close

from kernels import cpu_flags, cpu_ops
from kernels.interface import (
    HUGE_PAGE_BYTES,
    HUGE_PAGES_ENV,
    KEY_LAYOUTS,
    WEIGHT_HUGE_PAGES_ENV,
    key_layout_of,
    kv_huge_pages,
    new_kv_cache,
    weight_huge_pages,
)
from kernels.torch_ref import TorchAttentionBackend

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = sorted({cpu_ops.build_isa(isa) for isa in cpu_flags.supported_isas()})
X86 = platform.machine() in ("x86_64", "AMD64")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Elementwise kernels round once where torch rounds after every op: tolerances per dtype.
ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _ops(isa: str):
    module = cpu_ops.load(isa)
    assert module is not None, f"the {isa} build of kernels/csrc/cpu_ops.cpp failed to compile"
    assert module.isa().startswith(isa)
    return module


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 96, 128])
@pytest.mark.parametrize("many", [False, True], ids=["per-kv-head", "per-sequence"])
@pytest.mark.parametrize("keys", KEY_LAYOUTS)
def test_decode_attention_matches_the_reference(isa, dtype, head_dim, many, keys):
    # Whole sequences per thread when there are at least 4 per thread, else one (sequence, KV
    # head) per work item; contexts that are not multiples of the vector width; GQA of 3; keys
    # in rows or token-minor (kernels.interface), blocks of 16 and 32.
    rng = random.Random(head_dim)
    count = 4 * torch.get_num_threads() + 3 if many else 2
    seqs = [(rng.randint(1, 120), 1) for _ in range(count)]
    block_size = 32 if many else 16
    case = Case(seqs, block_size, 6, 2, head_dim, dtype, seed=head_dim, key_layout=keys)
    backend = TorchAttentionBackend(isa=isa)
    assert backend._cpu_kernel is _ops(isa)
    out, _, _ = case.run(backend)
    check_close(out, case.naive(), dtype)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 96, 128])
@pytest.mark.parametrize("keys", KEY_LAYOUTS)
def test_a_step_with_prefills_runs_in_one_kernel_call(isa, dtype, head_dim, keys):
    # paged_prefill: plain prefills (causal among their own tokens) shorter and longer than a
    # query tile (16 tokens), chunks after a cached prefix, decodes, contexts across blocks and
    # not multiples of the vector width; GQA of 3; keys in rows or token-minor.
    seqs = [(0, 37), (45, 20), (70, 1), (0, 1), (16, 16), (0, 2), (100, 33)]
    case = Case(seqs, 16, 6, 2, head_dim, dtype, seed=head_dim, key_layout=keys)
    backend = TorchAttentionBackend(isa=isa)
    calls = []
    kernel = backend._cpu_kernel
    backend._cpu_kernel = _Recording(kernel, calls)
    out, _, _ = case.run(backend)
    assert calls == ["paged_prefill"]
    check_close(out, case.naive(), dtype)
    # The torch path (SDPA per prefill) computes the same attention, and so does the kernel
    # backend with prefills switched back to SDPA (what `bench prefill` compares).
    torch_out, _, _ = case.run(TorchAttentionBackend(use_cpu_kernel=False))  # either layout
    check_close(out, torch_out.to(torch.float64), dtype)
    backend.prefill_in_kernel = False
    calls.clear()
    sdpa_out, _, _ = case.run(backend)
    assert "paged_prefill" not in calls
    check_close(sdpa_out, torch_out.to(torch.float64), dtype)


@pytest.fixture
def scorer():
    """Sets how a build's decode attention scores keys (``set_decode_scores``), and puts every
    loaded build back on ``auto`` afterwards (the setting is the build's, not the call's)."""
    modules = []

    def use(module, mode: str) -> str:
        modules.append(module)
        return module.set_decode_scores(mode)

    yield use
    for module in modules:
        module.set_decode_scores("auto")


# Shapes for the tile path: GQA groups of 3 (SmolLM2), 16 query heads on one KV head (a full
# tile of columns), MHA; head_dim one to four tile rows of 32; blocks of one and two tiles, and
# blocks of 8 (not a whole tile: the FMA path serves them); contexts ending mid-tile.
TILE_SHAPES = [
    (block_size, heads, kv_heads, head_dim)
    for block_size in (16, 32, 8)
    for heads, kv_heads in ((9, 3), (16, 1), (4, 4))
    for head_dim in (32, 64, 128)
]


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("many", [False, True], ids=["per-kv-head", "per-sequence"])
@pytest.mark.parametrize("keys", ["rows", "heads"])
def test_decode_scores_as_emulated_tile_products_match_the_reference(isa, many, keys, scorer):
    # The tile path's arithmetic in plain C++ (every build has it): the queries' pair layout,
    # the walk over blocks, the padded score rows and their softmax, on any CPU; keys in rows
    # or head-major (the tiles load either with its row stride).
    module = _ops(isa)
    scorer(module, "emulated")
    rng = random.Random(7)
    for block_size, heads, kv_heads, head_dim in TILE_SHAPES:
        count = 4 * torch.get_num_threads() + 3 if many else 2
        seqs = [(rng.randint(1, 90), 1) for _ in range(count)] + [(15, 1), (31, 1)]
        case = Case(
            seqs, block_size, heads, kv_heads, head_dim, torch.bfloat16, seed=head_dim,
            key_layout=keys,
        )  # fmt: skip
        out, _, _ = case.run(TorchAttentionBackend(isa=isa))
        check_close(out, case.naive(), torch.bfloat16)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("keys", ["rows", "heads"])
def test_decode_scores_by_amx_tiles_where_the_build_and_cpu_have_them(isa, keys, scorer):
    module = _ops(isa)
    if scorer(module, "auto") != "amx":
        # Only the AMX build has tiles, and only where Linux hands them out (5.16+): asking
        # for them anywhere else is an error, and "auto" keeps the FMAs.
        with pytest.raises(RuntimeError, match="no AMX tiles"):
            module.set_decode_scores("amx")
        return
    assert isa == "amx"
    rng = random.Random(11)
    for block_size, heads, kv_heads, head_dim in TILE_SHAPES:
        seqs = [(rng.randint(1, 200), 1) for _ in range(4 * torch.get_num_threads() + 1)]
        case = Case(
            seqs, block_size, heads, kv_heads, head_dim, torch.bfloat16, seed=head_dim,
            key_layout=keys,
        )  # fmt: skip
        outs = {}
        for mode in ("amx", "emulated", "fma"):
            scorer(module, mode)
            outs[mode], _, _ = case.run(TorchAttentionBackend(isa=isa))
            check_close(outs[mode], case.naive(), torch.bfloat16)
        # The tiles sum the same products as their emulation, in float32 in another order.
        torch.testing.assert_close(
            outs["amx"].double(), outs["emulated"].double(), atol=1e-2, rtol=1e-2
        )


def test_decode_scores_setting_names_its_choices(scorer):
    module = _ops(RUNNABLE[0])
    with pytest.raises(RuntimeError, match="auto, fma, amx or emulated"):
        module.set_decode_scores("tiles")


class _Recording:
    """A kernel module that records which entry points were called."""

    def __init__(self, module, calls: list[str]) -> None:
        self._module, self._calls = module, calls

    def __getattr__(self, name: str):
        self._calls.append(name)
        return getattr(self._module, name)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_a_key_cache_layout_the_kernels_cannot_read_is_refused(isa):
    ops = _ops(isa)
    case = Case([(20, 1), (40, 1)], 16, 6, 2, 64, torch.float32)
    k_cache, v_cache = case.caches()
    lens, tables = case.meta.seq_lens, case.meta.block_tables
    # Blocks innermost: none of rows, token-minor or head-major.
    odd = k_cache.permute(3, 1, 2, 0).contiguous().permute(3, 1, 2, 0)
    with pytest.raises(RuntimeError, match="contiguous \\(rows\\), token-minor .* or head-major"):
        ops.paged_decode(case.query, odd, v_cache, tables, lens, case.scale)
    with pytest.raises(RuntimeError, match="with keys in rows, v_cache must be contiguous"):
        ops.paged_decode(case.query, k_cache, odd, tables, lens, case.scale)
    # Token-minor keys come with head-major values (kernels.interface.new_kv_cache), not rows.
    token_keys, _ = new_kv_cache(*k_cache.shape, dtype=torch.float32, key_layout="tokens")
    with pytest.raises(RuntimeError, match="v_cache must be head-major"):
        ops.paged_decode(case.query, token_keys, v_cache, tables, lens, case.scale)
    with pytest.raises(RuntimeError, match="v_cache must be head-major"):
        ops.read_kv_once(token_keys, v_cache, tables, lens)
    head_keys, _ = new_kv_cache(*k_cache.shape, dtype=torch.float32, key_layout="heads")
    with pytest.raises(RuntimeError, match="with head-major keys, v_cache must be head-major"):
        ops.paged_decode(case.query, head_keys, v_cache, tables, lens, case.scale)
    # Token-minor keys need whole vectors of tokens in a block.
    narrow_k, narrow_v = new_kv_cache(4, 4, 2, 64, dtype=torch.float32, key_layout="tokens")
    with pytest.raises(RuntimeError, match="multiple of"):
        ops.read_kv_once(narrow_k, narrow_v, tables[:, :1] % 4, lens.clamp(max=4))


class _FakeKernel:
    def __init__(self, isa: str, width: int) -> None:
        self._isa, self._width = isa, width

    def isa(self) -> str:
        return self._isa

    def vector_width(self) -> int:
        return self._width


@pytest.mark.parametrize(
    ("isa", "width", "dtype", "block", "expected"),
    [
        ("amx (16 floats)", 16, torch.bfloat16, 16, "rows"),  # keys scored on AMX tiles
        ("amx (16 floats)", 16, torch.float32, 16, "tokens"),
        ("avx512 (16 floats)", 16, torch.bfloat16, 16, "tokens"),
        ("avx2 (8 floats)", 8, torch.float32, 16, "tokens"),
        ("avx512 (16 floats)", 16, torch.float32, 8, "rows"),  # a block narrower than a vector
    ],
)
def test_the_backend_chooses_the_key_layout_its_kernel_reads_fastest(
    monkeypatch, isa, width, dtype, block, expected
):
    monkeypatch.delenv("PREFIXMESH_KEY_LAYOUT", raising=False)
    backend = TorchAttentionBackend(use_cpu_kernel=False)
    assert backend.key_layout(dtype, block, 64) == "rows"  # the torch path: rows
    backend._cpu_kernel, backend._use_cpu_kernel = _FakeKernel(isa, width), True
    assert backend.key_layout(dtype, block, 64) == expected
    monkeypatch.setenv("PREFIXMESH_KEY_LAYOUT", "rows")
    assert backend.key_layout(dtype, block, 64) == "rows"
    monkeypatch.setenv("PREFIXMESH_KEY_LAYOUT", "tokens")
    assert backend.key_layout(dtype, block, 64) == ("tokens" if block % width == 0 else "rows")
    monkeypatch.setenv("PREFIXMESH_KEY_LAYOUT", "heads")  # any block size
    assert backend.key_layout(dtype, block, 64) == "heads"
    monkeypatch.setenv("PREFIXMESH_KEY_LAYOUT", "columns")
    with pytest.raises(ValueError, match="auto, rows, tokens or heads"):
        backend.key_layout(dtype, block, 64)


def test_new_kv_cache_makes_both_layouts_as_one_logical_shape():
    for keys in KEY_LAYOUTS:
        k, v = new_kv_cache(3, 16, 2, 8, dtype=torch.bfloat16, key_layout=keys)
        assert k.shape == v.shape == (3, 16, 2, 8)
        assert key_layout_of(k) == keys and not k.any() and not v.any()
    k, v = new_kv_cache(3, 16, 2, 8, dtype=torch.float32, key_layout="rows")
    assert k.is_contiguous() and v.is_contiguous()
    k, v = new_kv_cache(3, 16, 2, 8, dtype=torch.float32, key_layout="tokens")
    assert k.stride() == (2 * 8 * 16, 1, 8 * 16, 16)  # [blocks, heads, dims, tokens] storage
    assert v.stride() == (2 * 16 * 8, 8, 16 * 8, 1)  # [blocks, heads, tokens, dims] storage
    k, v = new_kv_cache(3, 16, 2, 8, dtype=torch.float32, key_layout="heads")
    assert k.stride() == v.stride() == (2 * 16 * 8, 8, 16 * 8, 1)
    with pytest.raises(ValueError, match="key_layout"):
        new_kv_cache(3, 16, 2, 8, dtype=torch.float32, key_layout="columns")


def _vm_flags(address: int) -> set[str]:
    """The kernel's flags for the mapping of this process that holds ``address`` (smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


# Whether this kernel has transparent huge pages at all (else it refuses MADV_HUGEPAGE).
THP = Path("/sys/kernel/mm/transparent_hugepage").is_dir() and Path("/proc/self/smaps").exists()


@pytest.mark.skipif(not THP, reason="needs a Linux kernel with transparent huge pages")
def test_a_kv_pool_on_huge_pages_is_the_same_tensor_on_advised_aligned_memory():
    """``huge_pages``: the same shapes, strides and zeros, on memory that starts on a 2 MB
    boundary and is advised for transparent huge pages (``hg``), where plain ``torch.zeros``
    memory is not (whether the kernel then backs it with huge pages is its THP setting's)."""
    for keys in KEY_LAYOUTS:
        plain = new_kv_cache(40, 16, 3, 64, dtype=torch.float32, key_layout=keys)
        huge = new_kv_cache(40, 16, 3, 64, dtype=torch.float32, key_layout=keys, huge_pages=True)
        for p, h in zip(plain, huge):
            assert h.shape == p.shape and h.stride() == p.stride() and h.dtype == p.dtype
            assert not h.any()
            assert h.data_ptr() % HUGE_PAGE_BYTES == 0
            assert "hg" in _vm_flags(h.data_ptr()), keys
        assert key_layout_of(huge[0]) == keys
    big = torch.zeros(8 << 20, dtype=torch.uint8)  # what torch's allocator gives: not advised
    assert "hg" not in _vm_flags(big.data_ptr())


@pytest.mark.parametrize(
    "env, setting", [(HUGE_PAGES_ENV, kv_huge_pages), (WEIGHT_HUGE_PAGES_ENV, weight_huge_pages)]
)
def test_the_huge_pages_settings_are_on_by_default_and_name_their_values(env, setting, monkeypatch):
    monkeypatch.delenv(env, raising=False)
    assert setting()
    monkeypatch.setenv(env, "0")
    assert not setting()
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError, match=f"{env} must be 0 or 1"):
        setting()


def test_our_own_packed_weights_move_onto_huge_pages_and_nothing_else_does():
    from kernels import cpu_linear

    gen = torch.Generator().manual_seed(4)
    ops = cpu_ops.load()
    w32 = torch.randn(48, 40, generator=gen)
    w16 = (torch.randn(32, 64, generator=gen) * 0.1).bfloat16()
    panels = cpu_linear.PanelPacked(ops.pack_panels(w32), ops)
    pairs = cpu_linear.pack_pairs(w16, "emulated")
    dense = torch.randn(8, 40, generator=gen)
    weights = [panels, dense, pairs]
    moved = cpu_linear.on_huge_pages(weights)
    assert moved is weights and moved[1] is dense  # in place; the dense weight as it was
    for before, after in zip((panels, pairs), (moved[0], moved[2])):
        assert type(after) is type(before) and after.packed is not before.packed
        assert torch.equal(after.packed, before.packed)
        assert after.packed.stride() == before.packed.stride()
        if THP:
            assert "hg" in _vm_flags(after.packed.data_ptr())
    # Both in one region, each on its own 4 KB boundary.
    assert moved[2].packed.data_ptr() - moved[0].packed.data_ptr() == 8192  # 7,680 bytes
    x = torch.randn(5, 40, generator=gen)
    assert torch.equal(cpu_linear.linear(x, moved[0]), cpu_linear.linear(x, panels))
    xb = torch.randn(5, 64, generator=gen).bfloat16()
    assert torch.equal(cpu_linear.linear(xb, moved[2]), cpu_linear.linear(xb, pairs))
    assert cpu_linear.on_huge_pages([dense]) == [dense]  # nothing of ours: no region


def test_a_kernel_that_refuses_the_huge_page_advice_gets_plain_zeros(monkeypatch):
    from kernels import interface

    class Refusing:  # a kernel built without THP answers MADV_HUGEPAGE with EINVAL
        def __init__(self, *args, **kwargs):
            self.closed = False

        def madvise(self, advice):
            raise OSError(22, "Invalid argument")

        def close(self):
            self.closed = True

    made = []

    def refusing_mmap(*args, **kwargs):
        made.append(Refusing())
        return made[-1]

    monkeypatch.setattr(interface.mmap, "mmap", refusing_mmap)
    t = interface.huge_page_zeros((4, 16), torch.float32)
    assert t.shape == (4, 16) and not t.any()
    assert made and made[0].closed


def _kv_pool(llm) -> list[int]:
    return [cache.data_ptr() for pair in llm.engine.runner.kv_caches for cache in pair]


def _packed_weights(llm) -> list[int]:
    from kernels import cpu_linear

    # (The LM head stays oneDNN's: the tiny vocabulary is no multiple of a panel.)
    weights = llm.engine.runner.model.gemm_weights()[:-1]
    assert all(isinstance(weight, cpu_linear.PanelPacked) for weight in weights)
    return [weight.packed.data_ptr() for weight in weights]


@pytest.mark.skipif(not THP, reason="needs a Linux kernel with transparent huge pages")
@pytest.mark.parametrize(
    "env, addresses", [(HUGE_PAGES_ENV, _kv_pool), (WEIGHT_HUGE_PAGES_ENV, _packed_weights)]
)
def test_the_engine_puts_its_kv_pool_and_weights_on_huge_pages_unless_told_not_to(
    env, addresses, tiny_model_dir, monkeypatch
):
    from kernels import cpu_linear
    from replica import LLM, SamplingParams

    monkeypatch.setenv(cpu_linear.F32_GEMM_ENV, "panels")  # our own GEMM's weights, any build
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 11, 200, 7], list(range(40, 75))]
    outputs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(env, setting)
        llm = LLM(str(tiny_model_dir), dtype="float32")
        for address in addresses(llm):
            assert ("hg" in _vm_flags(address)) == (setting == "1")
        outputs[setting] = [out.token_ids for out in llm.generate(prompts, params)]
    assert outputs["1"] == outputs["0"]


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("keys", KEY_LAYOUTS)
def test_the_read_floor_reads_every_attended_key_and_value_once(isa, keys):
    # read_kv_once, the benchmarks' attention floor, sums what it reads: each sequence's keys
    # and values, counted once, in either layout (values head-major next to token-minor keys,
    # last blocks partly filled). Unused key slots are zeros (token-minor keys are read a whole
    # block at a time, as the kernel reads them), unused value slots NaN: never read.
    ops = _ops(isa)
    block, kv_heads, head_dim = 16, 3, 64
    lens = [37, 16, 1, 70]
    tables = torch.tensor([[5, 2, 9, 0, 0], [7, 0, 0, 0, 0], [1, 0, 0, 0, 0], [3, 8, 4, 6, 10]])
    k_cache, v_cache = new_kv_cache(
        11, block, kv_heads, head_dim, dtype=torch.float32, key_layout=keys
    )
    v_cache.fill_(float("nan"))
    gen = torch.Generator().manual_seed(1)
    expected = 0.0
    for row, n in zip(tables.tolist(), lens):
        for t in range(n):
            k, v = torch.rand(2, kv_heads, head_dim, generator=gen)
            k_cache[row[t // block], t % block] = k
            v_cache[row[t // block], t % block] = v
            expected += float(k.double().sum() + v.double().sum())
    got = ops.read_kv_once(k_cache, v_cache, tables.int(), torch.tensor(lens, dtype=torch.int32))
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_decode_items_are_split_between_threads_by_work_not_by_count(isa):
    # paged_decode and read_kv_once give each thread a contiguous range of sequences
    # (balanced_cuts): in a server's batch the oldest requests, first, have the longest
    # contexts, and an equal count each would leave one thread most of the reads.
    ops = _ops(isa)
    aged = [1750 - 100 * i for i in range(16)]  # 7x to 1x along the batch
    cuts = ops.balanced_cuts(aged, 2)
    first, second = sum(aged[: cuts[1]]), sum(aged[cuts[1] :])
    assert cuts[0] == 0 and cuts[2] == 16 and cuts[1] < 8
    assert abs(first - second) <= max(aged)
    assert ops.balanced_cuts([5] * 8, 2) == [0, 4, 8]
    assert ops.balanced_cuts([5] * 3, 4) == [0, 1, 2, 3]  # never more ranges than items
    assert ops.balanced_cuts([1, 1000, 1], 3) == [0, 1, 2, 3]  # none empty
    rng = random.Random(3)
    for _ in range(200):
        threads = rng.randint(1, 4)
        costs = [rng.randint(1, 1500) for _ in range(rng.randint(4 * threads, 64))]
        cuts = ops.balanced_cuts(costs, threads)
        assert cuts[0] == 0 and cuts[-1] == len(costs) and len(cuts) == threads + 1
        assert all(a < b for a, b in zip(cuts, cuts[1:]))
        share = sum(costs) / threads
        for a, b in zip(cuts, cuts[1:]):
            assert abs(sum(costs[a:b]) - share) <= 2 * max(costs)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_decode_attention_reads_a_strided_query(isa):
    # The model hands the kernel the query columns of the fused qkv projection: a view whose
    # rows are wider than the query.
    case = Case([(33, 1), (7, 1), (64, 1)], 16, 6, 2, 64, torch.float32, seed=5)
    wide = torch.zeros(3, 6 * 64 + 100)
    wide[:, : 6 * 64] = case.query.reshape(3, -1)
    query = wide[:, : 6 * 64].view(3, 6, 64)
    assert not query.is_contiguous()
    k_cache, v_cache = case.caches()
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    flat_k[case.meta.slot_mapping] = case.new_k
    flat_v[case.meta.slot_mapping] = case.new_v
    out = _ops(isa).paged_decode(
        query, k_cache, v_cache, case.meta.block_tables, case.meta.seq_lens, case.scale
    )
    check_close(out, case.naive(), torch.float32)


# --------------------------------------------------------------------------- elementwise
def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, in its order of operations."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 61])  # SmolLM2's, and one with a scalar tail
@pytest.mark.parametrize("rows", [9, 100])  # one thread's share, and split across threads
def test_rms_norm_and_its_residual_add(isa, dtype, width, rows):
    ops = _ops(isa)
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    _close(ops.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5), dtype)
    summed = residual + x  # the decoder's skip connection, rounded to dtype as HF stores it
    out = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, summed), "the residual is updated in place to residual + x"
    _close(out, _hf_rms_norm(summed, weight, 1e-5), dtype)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize(("keys", "block"), [("rows", 4), ("tokens", 16), ("heads", 4)])
def test_rope_rotates_q_and_k_and_writes_the_cache(isa, dtype, head_dim, keys, block):
    ops = _ops(isa)
    heads, kv_heads, tokens = 6, 2, 5
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 17, 4, 9])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(32).float(), inv_freq)
    k_cache, v_cache = new_kv_cache(8, block, kv_heads, head_dim, dtype=dtype, key_layout=keys)
    slots = torch.tensor([5, 30, -1, 0, 12])  # -1: a padding token, written nowhere
    # The reference: Hugging Face's rotate-half RoPE in float32 on every head.
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)[positions][:, None, :]
    sin = torch.cat([freqs.sin(), freqs.sin()], -1)[positions][:, None, :]
    heads_f = qkv.float().view(tokens, heads + 2 * kv_heads, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-heads_f[..., half:], heads_f[..., :half]], -1)
    expected = heads_f.clone()
    expected[:, : heads + kv_heads] = (heads_f * cos + rotated * sin)[:, : heads + kv_heads]
    ops.rope_write_kv(
        qkv, positions, freqs.cos().contiguous(), freqs.sin().contiguous(), heads, kv_heads,
        k_cache, v_cache, slots,
    )  # fmt: skip
    got = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    _close(got, expected, dtype)
    # (reshape: a copy in the tokens layout, read only)
    flat_k, flat_v = (
        k_cache.reshape(-1, kv_heads, head_dim),
        v_cache.reshape(-1, kv_heads, head_dim),
    )
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], got[t, heads : heads + kv_heads])
            assert torch.equal(flat_v[slot], got[t, heads + kv_heads :])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [7, 64])
def test_silu_and_mul(isa, dtype, rows):
    gen = torch.Generator().manual_seed(1)
    gate_up = (3 * torch.randn(rows, 2 * 1539, generator=gen)).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    _close(_ops(isa).silu_and_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_write_into_a_given_buffer_and_refuse_a_wrong_one(isa, dtype):
    """``out=`` (kernels/csrc/output.h: the buffers the model reuses for every layer): the bits
    a new tensor gets, in the caller's tensor; a buffer of the wrong shape, dtype or layout is
    refused with the op and what it needs."""
    ops = _ops(isa)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(9, 576, generator=gen).to(dtype)
    residual = torch.randn(9, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    gate_up = torch.randn(9, 2 * 96, generator=gen).to(dtype)
    case = Case([(33, 1), (7, 1), (64, 1)], 16, 6, 2, 64, dtype, seed=5)
    k_cache, v_cache = case.caches()
    meta = case.meta

    def norm(out=None):
        return ops.add_rms_norm(x, residual.clone(), weight, 1e-5, out=out)

    calls = {
        "add_rms_norm": (norm, (9, 576)),
        "silu_and_mul": (lambda out=None: ops.silu_and_mul(gate_up, out=out), (9, 96)),
        "paged_decode": (
            lambda out=None: ops.paged_decode(
                case.query, k_cache, v_cache, meta.block_tables, meta.seq_lens, case.scale, out=out
            ),
            (3, 6, 64),
        ),
    }
    for name, (call, shape) in calls.items():
        want = call()
        buffer = torch.full(shape, float("nan"), dtype=dtype)
        assert call(out=buffer).data_ptr() == buffer.data_ptr(), name
        assert torch.equal(buffer, want), name
        with pytest.raises(RuntimeError, match=f"{name}: out must be"):
            call(out=torch.empty(shape[:-1] + (shape[-1] + 1,), dtype=dtype))
        with pytest.raises(RuntimeError, match=f"{name}: out must be"):
            call(out=torch.empty(shape, dtype=torch.float16))
        with pytest.raises(RuntimeError, match=f"{name}: out must be contiguous"):
            call(out=torch.empty(shape[::-1], dtype=dtype).permute(*range(len(shape))[::-1]))


@pytest.mark.parametrize("isa", RUNNABLE)
def test_the_kernels_exp_is_within_one_ulp_with_its_edges_as_documented(isa):
    """The float32 exp of SiLU and the softmax (``exp_f32`` in cpu_ops.cpp): within one ulp of
    float64's exp wherever the result is a normal float below 2^127.5 (1.5 in the generic
    build, whose multiply-adds round twice), 0 below that range, infinity above it, NaN for
    NaN, across every lane and a scalar tail."""
    gen = torch.Generator().manual_seed(3)
    lo, hi = -87.33654, 88.37626
    spread = (30 * torch.randn(100_003, generator=gen)).clamp(lo + 1e-4, hi - 1e-4)
    x = torch.cat([torch.linspace(lo + 1e-4, hi - 1e-4, 2_000_003), spread])
    got = _ops(isa).exp_f32(x).double()
    want = torch.exp(x.double())
    ulp = torch.pow(2.0, torch.floor(torch.log2(want)).clamp(min=-126) - 23)
    assert ((got - want).abs() / ulp).max() <= (1.5 if isa == "generic" else 1.0)
    edges = torch.tensor([float("-inf"), -1000.0, -87.34, 0.0, -0.0, 88.38, 1000.0, float("inf")])
    assert _ops(isa).exp_f32(edges).tolist() == [0, 0, 0, 1, 1, *[float("inf")] * 3]
    assert _ops(isa).exp_f32(torch.tensor([float("nan")] * 3)).isnan().all()


def _elementwise_outputs(ops, rows: int = 64, width: int = 576, heads=(9, 3), head_dim: int = 64):
    """Every bfloat16 elementwise kernel's outputs on one set of inputs, with denormals, NaNs,
    infinities and signed zeros among them."""
    gen = torch.Generator().manual_seed(7)
    special = torch.tensor([1e-39, -1e-39, 3e-41, float("nan"), float("inf"), -0.0, 0.0, 1e-38])

    def randn(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen)
        t.view(-1)[: 4 * len(special)] = special.repeat(4)
        return t.to(torch.bfloat16)

    x, residual, weight = randn(rows, width), randn(rows, width), randn(width)
    q_heads, kv_heads = heads
    qkv = randn(rows, (q_heads + 2 * kv_heads) * head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(512).float(), inv_freq)
    k_cache, v_cache = new_kv_cache(8, 16, kv_heads, head_dim, dtype=torch.bfloat16)
    ops.rope_write_kv(
        qkv, torch.arange(rows) * 7, freqs.cos().contiguous(), freqs.sin().contiguous(),
        q_heads, kv_heads, k_cache, v_cache, torch.arange(rows),
    )  # fmt: skip
    normed = ops.add_rms_norm(x, residual, weight, 1e-5)
    return [ops.rms_norm(x, weight, 1e-5), normed, residual, qkv, k_cache, v_cache,
            ops.silu_and_mul(randn(rows, 2 * 1536))]  # fmt: skip


@pytest.mark.parametrize("isa", RUNNABLE)
def test_bfloat16_conversion_in_hardware_gives_the_emulations_bits(isa):
    """AVX-512 builds on a CPU with AVX-512 BF16 round bfloat16 with vcvtne2ps2bf16, others with
    ATen's integer emulation; ``set_bf16_convert`` says which runs and turns the instruction off,
    and both must give every kernel the same bits, special values included."""
    ops = _ops(isa)
    has_instruction = "avx512_bf16" in (cpu_flags.cpu_flags() or ())
    expected = "native" if isa in ("avx512", "amx") and has_instruction else "emulated"
    try:
        assert ops.set_bf16_convert("auto") == expected
        native = _elementwise_outputs(ops)
        assert ops.set_bf16_convert("emulated") == expected
        emulated = _elementwise_outputs(ops)
    finally:
        ops.set_bf16_convert("auto")
    for got, want in zip(native, emulated, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(RuntimeError, match="auto or emulated"):
        ops.set_bf16_convert("fast")


# --------------------------------------------------------------------------- builds and caps
def _compiles(isa: str) -> subprocess.CompletedProcess:
    from torch.utils.cpp_extension import include_paths

    cmd = ["c++", "-std=c++20", "-fsyntax-only", "-fopenmp", *cpu_ops.BUILD_FLAGS[isa],
           "-DTORCH_EXTENSION_NAME=check", *[f"-I{p}" for p in include_paths()],
           f"-I{sysconfig.get_paths()['include']}", *map(str, cpu_ops.SOURCES)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "isa", [isa for isa in cpu_ops.BUILD_FLAGS if X86 and isa not in RUNNABLE] or ["generic"]
)
def test_builds_this_cpu_cannot_run_still_compile(isa):
    # The runnable builds are compiled (and tested) above; these only get a syntax check.
    result = _compiles(isa)
    assert result.returncode == 0, result.stderr[-3000:]


def _cpuinfo(tmp_path: Path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    return str(path)


AVX2 = "fpu sse4_2 avx avx2 fma f16c"
AVX512 = AVX2 + " avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni"
AMX = AVX512 + " amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize(
    ("flags", "native", "supported"),
    [
        (AVX2, "avx2", ("generic", "avx2")),
        (AVX512, "avx512", ("generic", "avx2", "avx512")),
        (AMX, "amx", ("generic", "avx2", "avx512", "amx")),
        ("fpu sse4_2", "generic", ("generic",)),
    ],
    ids=["avx2", "avx512", "amx", "old"],
)
def test_isa_levels_of_the_three_machine_kinds(tmp_path, monkeypatch, flags, native, supported):
    monkeypatch.delenv(cpu_flags.ISA_ENV, raising=False)
    cpuinfo = _cpuinfo(tmp_path, flags)
    assert cpu_flags.native_isa(cpuinfo) == cpu_flags.cpu_isa(cpuinfo) == native
    assert cpu_flags.supported_isas(cpuinfo) == supported


@pytest.mark.parametrize(
    ("cap", "isa", "dtype", "gone", "kept"),
    [
        ("amx", "amx", "bfloat16", set(), {"amx_bf16", "avx512_bf16", "avx2"}),
        ("avx512", "avx512", "bfloat16", {"amx_tile", "amx_bf16"}, {"avx512_bf16", "avx2"}),
        ("avx2", "avx2", "float32", {"avx512f", "avx512_bf16", "amx_bf16"}, {"avx2", "fma"}),
        ("generic", "generic", "float32", {"avx2", "fma", "avx512f", "amx_tile"}, {"sse4_2"}),
    ],
)
def test_the_cap_makes_an_amx_machine_report_another_kind(
    tmp_path, monkeypatch, cap, isa, dtype, gone, kept
):
    from replica import engine

    cpuinfo = _cpuinfo(tmp_path, AMX)
    monkeypatch.setenv(cpu_flags.ISA_ENV, cap)
    flags = cpu_flags.cpu_flags(cpuinfo)
    assert not flags & gone and kept <= flags
    assert cpu_flags.cpu_isa(cpuinfo) == isa
    assert cpu_flags.native_isa(cpuinfo) == "amx"  # the cap never hides what the CPU is
    # The dtype default follows the cap, as it would on that kind of machine.
    assert engine.cpu_has_native_bf16(cpuinfo) == (dtype == "bfloat16")


def test_the_cap_only_takes_away_and_rejects_unknown_levels(tmp_path, monkeypatch):
    cpuinfo = _cpuinfo(tmp_path, AVX2)
    monkeypatch.setenv(cpu_flags.ISA_ENV, "amx")  # more than the CPU has: nothing changes
    assert cpu_flags.cpu_isa(cpuinfo) == "avx2"
    assert cpu_flags.cpu_flags(cpuinfo) == frozenset(AVX2.split())
    monkeypatch.setenv(cpu_flags.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="PREFIXMESH_CPU_ISA must be one of"):
        cpu_flags.cpu_isa(cpuinfo)


def test_cap_torch_caps_torchs_own_kernels_unless_the_user_chose(monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(cpu_flags.ISA_ENV, raising=False)
    cpu_flags.cap_torch()  # no cap: torch keeps its own choice
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ and "ATEN_CPU_CAPABILITY" not in os.environ
    monkeypatch.setenv(cpu_flags.ISA_ENV, "avx2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # set by the user: it wins
    cpu_flags.cap_torch()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default"


_UNDER_CAP = textwrap.dedent(
    """
    import json, os, sys
    from replica import LLM, SamplingParams
    from replica.engine import cpu_has_native_bf16, default_dtype
    from kernels.cpu_flags import cpu_isa
    # Greedy tokens, and the first token's top-20 log-probabilities (teacher-forced: the same
    # prompt on both paths, so a near-tie flipped by rounding cannot derail the comparison).
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    prompts = [[5, 9, 11, 200, 7], list(range(40, 75)), [3] * 20]
    result = {"isa": cpu_isa(), "auto": default_dtype("cpu"), "bf16": cpu_has_native_bf16()}
    runs = [("1", sys.argv[2]), ("0", sys.argv[2]), ("1f32", "float32")]
    for kernels, dtype in runs:
        os.environ["PREFIXMESH_CPU_KERNELS"] = kernels[0]
        llm = LLM(sys.argv[1], dtype=dtype)
        result["tokens" + kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        result["top" + kernels] = [
            dict(o.outputs[0].logprobs[0].top) for o in llm.generate(prompts, first)
        ]
        ops = llm.engine.runner.model.ops
        result["kernel" + kernels] = ops.isa() if ops is not None else None
    print("RESULT" + json.dumps(result))
    """
)


@pytest.mark.parametrize("cap", cpu_flags.supported_isas())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_under_every_cap_this_machine_supports(tiny_model_dir, cap, dtype):
    # A fresh process per cap, with torch's own kernels (oneDNN, ATen) capped too: the engine
    # runs as it would on that kind of machine, and its fused kernels compute what the torch
    # path computes: the same greedy tokens in float32, log-probabilities within bfloat16's
    # rounding in bfloat16.
    result = run_under_cap(_UNDER_CAP, [str(tiny_model_dir), dtype], cap, ROOT)
    assert result["isa"] == cap
    assert result["kernel1"].startswith(cpu_ops.build_isa(cap)) and result["kernel0"] is None
    # The dtype default follows the cap: never bfloat16 below AVX-512.
    assert result["auto"] == ("bfloat16" if result["bf16"] else "float32")
    assert not (result["bf16"] and cap in ("generic", "avx2"))
    if dtype == "float32":
        assert result["tokens1"] == result["tokens0"]

    def worst_gap(a: dict, b: dict) -> float:
        common = a.keys() & b.keys()
        assert len(common) >= 10
        return max(abs(a[t] - b[t]) for t in common)

    for fused, torch_path, exact in zip(result["top1"], result["top0"], result["top1f32"]):
        if dtype == "float32":
            assert worst_gap(fused, torch_path) < 1e-4
        else:
            # bfloat16 rounds differently on the two paths (torch after every op, the fused
            # kernels once per kernel): the fused path must be no further from float32.
            assert worst_gap(fused, exact) <= 1.25 * worst_gap(torch_path, exact) + 0.02


# --------------------------------------------------------------------------- greedy sampling
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 37])  # SmolLM2's, and one with a scalar tail
def test_argmax_rows_is_torchs_argmax(isa, dtype, vocab):
    # First index on ties, a row's first NaN, an all -inf row (every id suppressed), a maximum
    # in the scalar tail, and rows of a wider tensor (the sampler's buffers are views).
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(9, vocab + 5, generator=gen).to(dtype)
    x = wide[:, :vocab]
    x[1, 3] = x[1, vocab // 2] = 1e4
    x[2, vocab - 1] = 1e4
    x[3, 7] = x[3, 11] = float("nan")
    x[4] = float("-inf")
    x[5] = 0.0
    assert _ops(isa).argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------- the GIL
def _wakeups_during(call) -> tuple[int, float]:
    """How often a thread that sleeps 5 ms at a time woke up and ran Python while ``call()``
    ran, and how long it ran. Holding the GIL, a call lets it run at most once (between the
    reads of the count around the call); without it, about once per 5 ms."""
    count, stop = 0, threading.Event()

    def tick() -> None:
        nonlocal count
        while not stop.is_set():
            time.sleep(0.005)
            count += 1

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.05)
    try:
        before, started = count, time.perf_counter()
        call()
        seconds, after = time.perf_counter() - started, count
    finally:
        stop.set()
        thread.join()
    return after - before, seconds


def _long_call(make, min_seconds: float = 0.25):
    """``make(scale)`` for the first scale of 1, 2, 4, ... whose call takes ``min_seconds``."""
    for scale in (1, 2, 4, 8, 16, 32, 64):
        call = make(scale)
        started = time.perf_counter()
        call()
        if time.perf_counter() - started >= min_seconds:
            return call
    pytest.fail("no call took long enough to measure")


def _gemm(ops, kind: str, scale: int):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 1024, generator=gen)
    x = torch.randn(512 * scale, 1024, generator=gen)
    if kind == "pairs_linear":  # the emulation: every build and CPU has it
        packed = ops.pack_pairs(weight.bfloat16())
        return lambda: ops.pairs_linear(x.bfloat16(), packed, None, True)
    packed = ops.pack_panels(weight)
    return lambda: ops.panels_linear(x, packed, None)


def _attention(ops, kind: str, scale: int):
    # SmolLM2's heads (9 on 3 KV heads of 64) over 2,048 cached tokens in 16-token blocks;
    # decode: 128 x scale sequences sharing those blocks; prefill: one prompt of 512 x scale.
    gen = torch.Generator().manual_seed(0)
    tokens = 2048 if kind == "paged_decode" else 512 * scale
    blocks = tokens // 16
    k_cache = torch.randn(blocks, 16, 3, 64, generator=gen)
    v_cache = torch.randn(blocks, 16, 3, 64, generator=gen)
    if kind == "paged_decode":
        seqs = 128 * scale
        query = torch.randn(seqs, 9, 64, generator=gen)
        tables = torch.arange(blocks, dtype=torch.int32).repeat(seqs, 1)
        lens = torch.full((seqs,), tokens, dtype=torch.int32)
        return lambda: ops.paged_decode(query, k_cache, v_cache, tables, lens, 0.125)
    query = torch.randn(tokens, 9, 64, generator=gen)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    return lambda: ops.paged_prefill(query, k_cache, v_cache, tables, starts, lens, 0.125)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kind", ["pairs_linear", "panels_linear", "paged_decode", "paged_prefill"])
def test_the_long_kernels_let_other_threads_run(isa, kind):
    """A replica's event loop (gRPC, a peer's block fetch, the Redis lease) shares the process
    with the engine's step: a GEMM or attention call of tens of ms must not hold the GIL."""
    ops = _ops(isa)
    build = _gemm if kind.endswith("linear") else _attention
    wakeups, seconds = _wakeups_during(_long_call(lambda scale: build(ops, kind, scale)))
    assert wakeups >= 5, f"{kind}: {wakeups} wakeups in {seconds:.2f} s"
    # The control: a C call that holds the GIL (sorting floats runs no bytecode) lets the
    # sleeping thread run at most twice, however long it takes.
    numbers = [random.random() for _ in range(2_000_000)]
    wakeups, seconds = _wakeups_during(lambda: sorted(numbers))
    assert wakeups <= 2, f"sorted: {wakeups} wakeups in {seconds:.2f} s"


def test_an_installed_package_ships_every_file_the_kernel_build_reads():
    """A wheel (``pip install .``, the replica's image) holds what pyproject.toml's package-data
    names: every source and every header the sources include must be there, and in
    ``cpu_ops.HEADERS`` (the build's digest), or the kernels cannot build where it is installed."""
    import fnmatch
    import re

    import tomllib

    from kernels import cpu_ops

    folder = Path(cpu_ops.__file__).resolve().parent
    pyproject = tomllib.loads((folder.parent / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["kernels"]
    included = {
        name
        for source in cpu_ops.SOURCES
        for name in re.findall(r'^#include "([^"]+)"', source.read_text(), re.MULTILINE)
    }
    assert included and included <= {header.name for header in cpu_ops.HEADERS}
    for path in (*cpu_ops.SOURCES, *cpu_ops.HEADERS):
        name = path.resolve().relative_to(folder).as_posix()
        assert any(fnmatch.fnmatch(name, pattern) for pattern in shipped), name
