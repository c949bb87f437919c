"""The Triton attention backend: paged KV writes and one varlen paged attention launch per layer.

On CUDA tensors the kernels are compiled with ``triton.jit``; on any other device (or with
``TRITON_INTERPRET=1``) they run under Triton's CPU interpreter, which is how the tests check
them without a GPU (about 100x slower than the torch backend: for verification only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.interface import AttentionBackend, AttentionMetadata

_LOG2E = 1.4426950408889634
# Rows per attention program below which a query block counts as "decode-like" (see _tiling).
_MIN_BLOCK_M = 16
_PREFILL_BLOCK_M = 64
# Flash-decoding: split a long context over several programs only past this many positions.
_MIN_SPLIT_LEN = 1024


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _QueryBlocks:
    """Which sequence and which block of its new tokens each attention program handles."""

    meta: AttentionMetadata
    block_q: int
    seq: torch.Tensor  # [num_q_blocks] int32
    idx: torch.Tensor  # [num_q_blocks] int32

    @property
    def count(self) -> int:
        return int(self.seq.shape[0])


def _build_query_blocks(
    meta: AttentionMetadata, block_q: int, device: torch.device
) -> _QueryBlocks:
    q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
    per_seq = (q_lens + block_q - 1) // block_q
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), per_seq)
    first = torch.cumsum(per_seq, 0) - per_seq
    idx = torch.arange(int(per_seq.sum())) - torch.repeat_interleave(first, per_seq)
    both = torch.stack([seq, idx]).to(torch.int32).to(device)  # one host-to-device copy
    return _QueryBlocks(meta=meta, block_q=block_q, seq=both[0], idx=both[1])


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through Triton kernels (see ``kernels/triton_kernels.py``).

    ``tile_n`` (context positions per inner step) and ``num_splits`` (flash-decoding splits)
    default to heuristics; tests pin them to exercise every code path.
    """

    name = "triton"

    def __init__(self, tile_n: int | None = None, num_splits: int | None = None) -> None:
        if tile_n is not None and (tile_n < 16 or tile_n & (tile_n - 1)):
            raise ValueError(f"tile_n must be a power of two >= 16 (got {tile_n})")
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 (got {num_splits})")
        self.tile_n = tile_n
        self.num_splits = num_splits
        self._blocks: _QueryBlocks | None = None
        self._num_sms: int | None = None

    @staticmethod
    def _interpret(device: torch.device) -> bool:
        return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"

    @staticmethod
    def _kernels(device: torch.device):
        from kernels.triton_kernels import get_kernels  # imports triton only when used

        return get_kernels(TritonAttentionBackend._interpret(device))

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        # The query-block plan depends on the GQA group size, known only in attend(); it is
        # built by the first layer of the step and reused by the others.
        self._blocks = None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        self._kernels(key.device).store_kv[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            *key.stride(),
            *value.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            k_cache.shape[1],
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=_next_pow2(num_kv_heads),
            BLOCK_D=_next_pow2(head_dim),
        )

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if num_tokens == 0:
            return out
        group = num_heads // num_kv_heads
        block_m, block_q, tile_n = self._tiling(meta, group, head_dim)
        blocks = self._query_blocks(meta, block_q, query.device)
        num_splits = self._splits(meta, blocks.count * num_kv_heads, query.device)
        block_d = max(16, _next_pow2(head_dim))  # tl.dot needs >= 16 in every dimension
        if num_splits > 1:
            part_acc = torch.empty(
                (num_tokens, num_heads, num_splits, block_d),
                dtype=torch.float32,
                device=query.device,
            )
            part_ml = torch.empty(
                (num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=query.device
            )
        else:  # never read: the kernel writes the output directly
            part_acc = part_ml = out
        kernels = self._kernels(query.device)
        kernels.paged_attention[(blocks.count, num_kv_heads, num_splits)](
            out,
            part_acc,
            part_ml,
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            blocks.seq,
            blocks.idx,
            scale * _LOG2E,
            k_cache.shape[1],
            *query.stride(),
            *out.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            meta.block_tables.stride(0),
            NUM_HEADS=num_heads,
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            TILE_N=tile_n,
            NUM_SPLITS=num_splits,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            # Triton's interpreter multiplies bfloat16 as raw integers (triton 3.x): upcast.
            UPCAST_DOT=self._interpret(query.device) and k_cache.dtype == torch.bfloat16,
        )
        if num_splits > 1:
            kernels.merge_splits[(num_tokens, num_heads)](
                out,
                part_acc,
                part_ml,
                *out.stride(),
                NUM_HEADS=num_heads,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                NUM_SPLITS=num_splits,
                BLOCK_S=_next_pow2(num_splits),
            )
        return out

    def _tiling(self, meta: AttentionMetadata, group: int, head_dim: int) -> tuple[int, int, int]:
        """Rows per program, new tokens per program, context positions per inner step."""
        min_m = max(_MIN_BLOCK_M, _next_pow2(group))
        # Decode-only steps use the smallest tile (their rows are mostly empty anyway); prefill
        # chunks use taller tiles so each key/value tile is reused by more queries.
        if meta.max_query_len * group <= min_m:
            block_m = min_m
        else:
            block_m = max(min_m, _PREFILL_BLOCK_M)
        tile_n = self.tile_n or (64 if head_dim <= 64 else 32)
        return block_m, block_m // group, tile_n

    def _query_blocks(
        self, meta: AttentionMetadata, block_q: int, device: torch.device
    ) -> _QueryBlocks:
        cached = self._blocks
        if cached is not None and cached.meta is meta and cached.block_q == block_q:
            return cached
        self._blocks = _build_query_blocks(meta, block_q, device)
        return self._blocks

    def _splits(self, meta: AttentionMetadata, num_programs: int, device: torch.device) -> int:
        """Flash-decoding splits: only when the grid would leave most of the GPU idle."""
        if self.num_splits is not None:
            return self.num_splits
        if self._interpret(device) or meta.max_seq_len < 2 * _MIN_SPLIT_LEN:
            return 1
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        if num_programs >= self._num_sms:
            return 1
        wanted = _cdiv(2 * self._num_sms, num_programs)
        splits = max(1, min(wanted, meta.max_seq_len // _MIN_SPLIT_LEN, 64))
        # A power of two: NUM_SPLITS is a compile-time constant, so few variants get compiled.
        return 1 << (splits.bit_length() - 1)
