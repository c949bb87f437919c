"""Attention backends behind one varlen paged interface (see ``kernels.interface``).

``torch`` is the CPU path and the test oracle; ``triton`` runs on CUDA (and on CPU under
``TRITON_INTERPRET=1`` for tests). ``auto`` picks triton on CUDA and torch elsewhere.
"""

from __future__ import annotations

from kernels.interface import AttentionBackend, AttentionMetadata

BACKENDS = ("auto", "torch", "triton")


def get_backend(name: str, device: str) -> AttentionBackend:
    """The attention backend called ``name`` for ``device`` (``auto``: triton on CUDA)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS} (got {name!r})")
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    if name == "triton":
        from kernels.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from kernels.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend(device=str(device))


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "get_backend"]
