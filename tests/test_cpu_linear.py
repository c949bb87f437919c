"""kernels/cpu_linear.py: oneDNN-packed weights multiply like F.linear, or fall back to it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_under_cap

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


def test_float32_weights_are_packed_where_onednn_is_available():
    w = torch.randn(8, 16)
    assert cpu_linear.pack(w).is_mkldnn == torch.backends.mkldnn.is_available()


def test_disabled_by_environment_keeps_weights_dense(monkeypatch):
    monkeypatch.setenv("PREFIXMESH_ONEDNN", "0")
    w = torch.randn(8, 16)
    assert cpu_linear.pack(w) is w
    x = torch.randn(3, 16)
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w))


def test_unsupported_dtype_falls_back_to_dense(monkeypatch):
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
