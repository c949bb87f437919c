"""Executes a ``SchedulerOutput``: builds the packed batch, runs the model, returns logits.

Owns the KV cache tensors (per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` for
keys and for values) and the attention backend.
"""

from __future__ import annotations

import torch

from kernels import get_backend
from kernels.interface import AttentionMetadata, kv_huge_pages, new_kv_cache
from replica import config
from replica.model import LlamaModel
from replica.model_config import ModelConfig
from replica.scheduler_output import SchedulerOutput

# The engine's dtype names (replica/config.py) as torch dtypes.
DTYPES = {name: getattr(torch, name) for name in config.DTYPES if name != "auto"}


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    """Runs one forward per engine step over the packed batch."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        attention_backend: str,
        num_host_blocks: int = 0,
        batch_invariant: bool = False,
    ) -> None:
        self.config = model_config
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.attention = get_backend(attention_backend, str(device))
        self.model = LlamaModel(
            model_config, weights, self.attention, dtype, device, max_model_len, batch_invariant
        )
        heads, head_dim = model_config.num_kv_heads, model_config.head_dim
        # Keys in the layout the attention backend reads fastest (kernels.interface).
        self.key_layout = self.attention.key_layout(dtype, block_size, head_dim)
        layout = {"dtype": dtype, "key_layout": self.key_layout}
        # On a CPU, on huge pages: the kernels read it in blocks scattered over the pool.
        huge = kv_huge_pages()
        self.kv_caches = [
            new_kv_cache(
                num_blocks, block_size, heads, head_dim, device=device, huge_pages=huge, **layout
            )
            for _ in range(model_config.num_layers)
        ]
        # Host swap space for preempted sequences (pinned when the device is a GPU).
        pin = device.type == "cuda"
        self.host_caches = [
            new_kv_cache(num_host_blocks, block_size, heads, head_dim, pin_memory=pin, **layout)
            for _ in range(model_config.num_layers if num_host_blocks else 0)
        ]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks within the device pool (copy-on-write)."""
        self._copy(copies, self.kv_caches, self.kv_caches)

    def write_blocks(
        self,
        blocks: list[int],
        rows: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> None:
        """Fill ``blocks`` in every layer with ``rows`` of ``keys`` / ``values`` (per layer,
        ``[n, block_size, num_kv_heads, head_dim]``): blocks fetched from a peer replica."""
        if not blocks:
            return
        dev = self.kv_caches[0][0].device
        dst = torch.tensor(blocks, device=dev)
        src = torch.tensor(rows)
        for (k_cache, v_cache), k, v in zip(self.kv_caches, keys, values, strict=True):
            k_cache.index_copy_(0, dst, k.index_select(0, src).to(dev))
            v_cache.index_copy_(0, dst, v.index_select(0, src).to(dev))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, ``(device, host)`` pairs."""
        self._copy(pairs, self.kv_caches, self.host_caches)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks, ``(host, device)`` pairs."""
        self._copy(pairs, self.host_caches, self.kv_caches)

    def _copy(self, pairs, src_caches, dst_caches) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=src_caches[0][0].device)
        dst = torch.tensor([d for _, d in pairs], device=dst_caches[0][0].device)
        for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches):
            dst_k[dst] = src_k[src].to(dst_k.device, non_blocking=True)
            dst_v[dst] = src_v[src].to(dst_v.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Logits (model dtype) for every scheduled sequence that reaches its last token this step,
        and the indices (into ``sched.scheduled``) of those sequences."""
        # Order matters: a block swapped out this step may be reused by a copy or a swap-in.
        self.swap_out(sched.swap_out)
        self.copy_blocks(sched.copies)
        self.swap_in(sched.swap_in)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sample_idx: list[int] = []
        for i, item in enumerate(sched.scheduled):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(table)
            if end == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sample_idx.append(i)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        self.attention.prepare(meta, bs)
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            self.kv_caches,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )
        return logits, sample_idx
