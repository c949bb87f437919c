"""Which kernels run a replica's model, as its log, ``GetModelInfo`` and ``prefixmesh top``
say it: the C++ CPU build and its ISA (``cpu_ops avx512 (prebuilt)``), Triton, or the torch
path, which is several times slower on a CPU and so is logged loudly (kernels/cpu_ops.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernels import cpu_ops

if TYPE_CHECKING:
    from replica.engine import LLMEngine


def kernel_build(engine: LLMEngine) -> str:
    """``engine``'s kernels in a few words (see the module docstring)."""
    attention = engine.runner.attention.name
    device = str(engine.config.device)
    if attention != "torch":
        return f"{attention} attention on {device}"
    if not device.startswith("cpu"):
        return f"torch path on {device}"
    if engine.runner.model.ops is None and not cpu_ops.describe().startswith("torch path"):
        return "torch path"
    return cpu_ops.describe()
