"""kernels/cpu_linear.py: oneDNN-packed weights multiply like F.linear, or fall back to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear


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
