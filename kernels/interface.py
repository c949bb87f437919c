"""The attention backend interface: varlen, paged, GQA.

One forward pass runs a packed batch of ``T`` new tokens from ``B`` sequences. Sequence ``b``
contributes ``q_len_b = query_start_loc[b+1] - query_start_loc[b]`` new tokens, which are the
last ``q_len_b`` positions of its context of ``seq_lens[b]`` tokens. A decode has ``q_len == 1``;
a prefill chunk has more, with any number of cached tokens before it (a prefix-cache hit or an
earlier chunk). Attention is causal among the new tokens and full over the cached prefix.

KV cache, per layer: ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (made by :func:`new_kv_cache`), in one of
three layouts named for their keys: ``rows`` (both contiguous: each token's heads one after
another); ``tokens``, where the keys are a permuted view of ``[num_blocks, num_kv_heads,
head_dim, block_size]`` storage (token-minor, so one dimension of a block's tokens is contiguous
for the CPU kernel's scores) and the values head-major; and ``heads``, keys and values both
head-major: permuted views of ``[num_blocks, num_kv_heads, block_size, head_dim]`` storage, so
that each KV head's rows in a block are one run. Each is the same tensor to torch: indexing,
copies and the wire format of fetched blocks do not depend on it. Token ``t`` of sequence ``b`` lives in block
``block_tables[b, t // block_size]`` at offset ``t % block_size``; ``slot_mapping[i]`` is the flat
slot ``block * block_size + offset`` for new token ``i``. Queries have ``num_heads`` heads, a
multiple of ``num_kv_heads`` (GQA: query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)``).
"""

from __future__ import annotations

import math
import mmap
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token of the packed batch sits; built once per step, shared by layers."""

    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU backends can plan without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


KEY_LAYOUTS = ("rows", "tokens", "heads")
# ``PREFIXMESH_KV_HUGE_PAGES=0`` keeps a CPU KV pool on the OS's 4 KB pages (kv_huge_pages),
# ``PREFIXMESH_WEIGHT_HUGE_PAGES=0`` the packed weights of our own GEMMs (weight_huge_pages).
HUGE_PAGES_ENV = "PREFIXMESH_KV_HUGE_PAGES"
WEIGHT_HUGE_PAGES_ENV = "PREFIXMESH_WEIGHT_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20


def new_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    key_layout: str = "rows",
    pin_memory: bool = False,
    huge_pages: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed ``(k_cache, v_cache)``, both ``[num_blocks, block_size, num_kv_heads,
    head_dim]``, stored as ``key_layout`` says for both (see the module's docstring);
    ``huge_pages``: in host memory advised for huge pages (:func:`huge_page_zeros`), where the
    device is the CPU and the memory is not pinned."""
    if key_layout not in KEY_LAYOUTS:
        raise ValueError(f"key_layout must be one of {KEY_LAYOUTS} (got {key_layout!r})")
    huge = huge_pages and torch.device(device).type == "cpu" and not pin_memory

    def zeros(*shape: int) -> torch.Tensor:
        if huge:
            return huge_page_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

    if key_layout == "rows":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return zeros(*shape), zeros(*shape)

    def head_major() -> torch.Tensor:
        return zeros(num_blocks, num_kv_heads, block_size, head_dim).transpose(1, 2)

    if key_layout == "heads":
        return head_major(), head_major()
    keys = zeros(num_blocks, num_kv_heads, head_dim, block_size)
    return keys.permute(0, 3, 1, 2), head_major()


def huge_page_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, *, prefault: bool = True
) -> torch.Tensor:
    """A zeroed CPU tensor on private anonymous memory that starts on a 2 MB boundary and is
    advised for transparent huge pages (``MADV_HUGEPAGE``; the kernel's THP setting must be
    ``madvise`` or ``always``, else it stays on 4 KB pages). Decode attention reads the KV pool
    a block at a time from blocks scattered over hundreds of MB: on 4 KB pages each block's
    rows cost TLB misses, which huge pages take away (docs/benchmarks.md: 10-17% off the
    kernel on a 2-core Zen 3 VM). Every page is touched here, so that none faults in later
    inside a step; ``prefault=False`` leaves that to a caller about to fill the tensor (the
    memory is zero either way). Where ``mmap`` cannot advise (not Linux, or a kernel built
    without THP, which refuses the advice), ``torch.zeros``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if advice is None or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=flags)
    try:
        region.madvise(advice)
    except OSError:  # EINVAL without CONFIG_TRANSPARENT_HUGEPAGE
        region.close()
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while it lives
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    tensor = raw[start : start + nbytes].view(dtype).view(shape)
    return tensor.zero_() if prefault else tensor


def kv_huge_pages() -> bool:
    """Whether a CPU engine puts its KV pool on huge pages (``PREFIXMESH_KV_HUGE_PAGES``:
    ``1``, the default, or ``0``)."""
    return _switch(HUGE_PAGES_ENV)


def weight_huge_pages() -> bool:
    """Whether a CPU engine copies the packed weights of its own GEMMs onto huge pages
    (``PREFIXMESH_WEIGHT_HUGE_PAGES``: ``1``, the default, or ``0``; kernels/cpu_linear.py
    ``on_huge_pages``)."""
    return _switch(WEIGHT_HUGE_PAGES_ENV)


def _switch(env: str) -> bool:
    setting = os.environ.get(env, "1").strip()
    if setting not in ("0", "1"):
        raise ValueError(f"{env} must be 0 or 1, got {setting!r}")
    return setting == "1"


def key_layout_of(k_cache: torch.Tensor) -> str:
    """``rows``, ``tokens`` or ``heads``: how ``k_cache`` (made by :func:`new_kv_cache`) is
    stored."""
    if k_cache.is_contiguous():
        return "rows"
    return "tokens" if k_cache.stride(1) == 1 else "heads"


class AttentionBackend(ABC):
    """Writes new keys/values into the paged cache and attends over it.

    Backends are stateless apart from what they precompute per step in ``prepare``.
    """

    name: str = "abstract"

    def key_layout(self, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
        """The key cache layout this backend reads fastest (``KEY_LAYOUTS``)."""
        return "rows"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:  # noqa: B027
        """Called once per step before the layers run (precompute per-step indices)."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Store the new tokens' keys and values into their cache slots."""

    @property
    def wants_new_kv(self) -> bool:
        """Whether this step's ``attend`` reads the views ``kv_written`` hands over (known
        after ``prepare``); when not, a caller that wrote the cache itself may skip making them."""
        return True

    def kv_written(self, key: torch.Tensor, value: torch.Tensor) -> None:  # noqa: B027
        """The caller wrote this step's new keys and values into the cache itself (a fused
        kernel did it with RoPE); ``key``/``value`` are ``[T, num_kv_heads, head_dim]`` views
        of them, which a backend may read instead of the cache."""

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output for every new token, ``[T, num_heads, head_dim]``: written into
        ``out`` and returned when given (a contiguous tensor of that shape and the query's
        dtype, which the model reuses for every layer), else a new tensor.

        The new tokens' keys and values must already be in the cache (``write_kv``).
        """
