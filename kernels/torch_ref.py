"""PyTorch attention backend: the CPU path and the oracle the Triton kernels are tested against.

Decodes (one new token each) run as one batched ``scaled_dot_product_attention`` over keys
gathered through the block tables and padded to the longest context. Prefill chunks run one
sequence at a time, causal among their new tokens and full over their cached prefix. GQA is
handled by folding each KV group's query heads into the query-length axis, so no key or value
is ever repeated per query head.

On a CPU with the C++ kernels (``kernels.cpu_ops``), decodes run in the kernel instead
(``paged_decode``), and so does a step with prefills: one ``paged_prefill`` call attends every
new token causally over its sequence, straight from the step's metadata.

All per-step indices (gather rows, masks, the kernels' tables) are built once in ``prepare``
and reused by every layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.interface import KEY_LAYOUTS, AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class _PrefillPlan:
    token_start: int
    token_end: int
    block_ids: torch.Tensor  # [num_blocks_used] int64
    context_len: int
    mask: torch.Tensor | None  # [q_len, context_len] bool, None = plain causal


@dataclass(slots=True)
class _DecodePlan:
    token_rows: torch.Tensor  # [Bd] int64, rows of the packed batch that are decodes
    block_ids: torch.Tensor | None  # [Bd, max_blocks] int64 (torch path only)
    block_tables: torch.Tensor  # [Bd, max_blocks] int32, for the C++ kernel
    seq_lens: torch.Tensor  # [Bd] int32
    context_len: int  # padded context (max_blocks * block_size)
    mask: torch.Tensor | None  # [Bd, 1, 1, context_len] bool, True = attend (torch path only)
    contiguous: bool  # decode rows form one slice [start, end)
    start: int
    end: int


class TorchAttentionBackend(AttentionBackend):
    """Paged varlen attention in plain PyTorch (any device, any float dtype).

    On a CPU, decodes use the C++ kernel of ``kernels.cpu_ops`` when it can be compiled
    (``use_cpu_kernel=None``: automatic); ``use_cpu_kernel=False`` keeps everything in torch.
    """

    name = "torch"

    def __init__(
        self, use_cpu_kernel: bool | None = None, device: str = "cpu", isa: str | None = None
    ) -> None:
        """``isa`` picks the kernels' build (``kernels.cpu_ops.build_isa``; default: this CPU's,
        under ``PREFIXMESH_CPU_ISA``), so tests can run every build the machine supports."""
        self._use_cpu_kernel = use_cpu_kernel
        self._cpu_kernel = None
        if use_cpu_kernel is not False and str(device) == "cpu":
            # Build (first run on a machine, ~1 min) or load it now, at start-up, not inside
            # the first request.
            from kernels import cpu_ops

            self._cpu_kernel = cpu_ops.load(isa)
            self._use_cpu_kernel = self._cpu_kernel is not None
        self._decode: _DecodePlan | None = None
        self._prefills: list[_PrefillPlan] = []
        self._varlen = False  # this step runs in paged_prefill (prepared only where it can)
        # Steps with prefills in the C++ kernel too (False: SDPA per prefill, for A/B runs).
        self.prefill_in_kernel = True
        # The keys/values last written: a prefill with no cached prefix attends to exactly
        # these, so it can skip gathering them back out of the paged cache.
        self._new_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        device = meta.block_tables.device
        # With prefills and the C++ kernel, the whole step is one paged_prefill call over the
        # step's own metadata (faster than torch's SDPA per sequence: docs/benchmarks.md); no
        # other plan is needed.
        kernel = self._use_cpu_kernel and device.type == "cpu" and self.prefill_in_kernel
        self._varlen = bool(kernel and max(meta.query_lens_cpu, default=1) > 1)
        if self._varlen:
            self._prefills, self._decode = [], None
            return
        decode_rows: list[int] = []
        decode_seqs: list[int] = []
        self._prefills = []
        start = 0
        for b, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 1:
                decode_rows.append(start)
                decode_seqs.append(b)
            else:
                num_blocks = -(-ctx // block_size)
                block_ids = meta.block_tables[b, :num_blocks].long()
                mask = None
                if ctx != q_len:  # cached prefix: causal mask offset by the prefix length
                    q_pos = torch.arange(ctx - q_len, ctx, device=device)
                    k_pos = torch.arange(ctx, device=device)
                    mask = k_pos[None, :] <= q_pos[:, None]
                self._prefills.append(_PrefillPlan(start, start + q_len, block_ids, ctx, mask))
            start += q_len
        self._decode = None
        if decode_rows:
            lens = [meta.seq_lens_cpu[b] for b in decode_seqs]
            max_blocks = -(-max(lens) // block_size)
            seq_index = torch.tensor(decode_seqs, device=device)
            tables = meta.block_tables[seq_index, :max_blocks].contiguous()
            context_len = max_blocks * block_size
            # The C++ kernel needs only the int32 tables and lengths; the gather + SDPA path
            # also needs int64 block ids and a padding mask.
            block_ids = mask = None
            if not (self._use_cpu_kernel and device.type == "cpu"):
                block_ids = tables.long()
                lens_t = torch.tensor(lens, device=device)
                mask = torch.arange(context_len, device=device)[None, :] < lens_t[:, None]
                mask = mask[:, None, None, :]
            contiguous = decode_rows[-1] - decode_rows[0] == len(decode_rows) - 1
            self._decode = _DecodePlan(
                torch.tensor(decode_rows, device=device),
                block_ids,
                tables,
                torch.tensor(lens, dtype=torch.int32, device=device),
                context_len,
                mask,
                contiguous,
                decode_rows[0],
                decode_rows[-1] + 1,
            )

    def key_layout(self, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
        """The KV cache layout (``kernels.interface``, named for its keys): ``tokens`` where
        the C++ kernel scores keys with FMAs (no sums across a vector's lanes in that layout;
        its values are head-major); ``rows`` on the torch path, and for bfloat16 on an AMX build,
        whose tile unit scores keys in rows (or head-major: ``heads``, not yet measured there).
        ``PREFIXMESH_KEY_LAYOUT=rows|tokens|heads`` overrides ``auto`` (where the kernel can
        read the layout), for A/B runs and tests."""
        setting = os.environ.get("PREFIXMESH_KEY_LAYOUT", "auto")
        if setting not in ("auto", *KEY_LAYOUTS):
            raise ValueError(
                f"PREFIXMESH_KEY_LAYOUT must be auto, rows, tokens or heads, got {setting!r}"
            )
        kernel = self._cpu_kernel if self._use_cpu_kernel else None
        if kernel is None:
            return "rows"
        if setting == "heads":
            return setting
        if block_size % kernel.vector_width() != 0:  # token-minor keys need whole vectors
            return "rows"
        if setting != "auto":
            return setting
        tiles = kernel.isa().startswith("amx") and dtype == torch.bfloat16
        return "rows" if tiles else "tokens"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self.kv_written(key, value)
        _write_slots(k_cache, slot_mapping, key)
        _write_slots(v_cache, slot_mapping, value)

    @property
    def wants_new_kv(self) -> bool:
        # Only a plain prefill on the SDPA path reads them (``attend``); the kernels read the
        # cache. A stale pair from an earlier step must never be read: dropped here.
        wants = any(plan.mask is None for plan in self._prefills)
        if not wants:
            self._new_kv = None
        return wants

    def kv_written(self, key, value) -> None:
        self._new_kv = (key, value)

    def attend(self, query, k_cache, v_cache, meta, scale, out=None) -> torch.Tensor:
        if self._varlen:
            result = self._cpu_kernel.paged_prefill(
                query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                scale,
            )  # fmt: skip
            return result if out is None else out.copy_(result)
        plan = self._decode
        if not self._prefills and plan is not None and plan.contiguous and self._kernel_runs(query):
            # A pure decode step: the kernel's output is the whole answer.
            return self._cpu_kernel.paged_decode(
                query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale, out=out
            )
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        for plan in self._prefills:
            q = query[plan.token_start : plan.token_end]  # [q_len, H, D]
            if plan.mask is None and self._new_kv is not None:
                # Plain prefill: causal over its own new tokens, GQA inside the kernel.
                k = self._new_kv[0][plan.token_start : plan.token_end]
                v = self._new_kv[1][plan.token_start : plan.token_end]
                # 4-D inputs take torch's fused CPU kernel (3-D ones a slower path).
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    is_causal=True, scale=scale, enable_gqa=True,
                )  # fmt: skip
                out[plan.token_start : plan.token_end] = o[0].transpose(0, 1)
                continue
            q_len = q.shape[0]
            k = k_cache[plan.block_ids].flatten(0, 1)[: plan.context_len]  # [ctx, KVH, D]
            v = v_cache[plan.block_ids].flatten(0, 1)[: plan.context_len]
            # Fold the query heads of each KV group into the length axis: [KVH, q_len*G, D].
            qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
            qg = qg.reshape(num_kv_heads, q_len * group, head_dim)
            mask = plan.mask
            if mask is None:  # a plain prefill called without its new keys (kv_written): the
                # same causal attention, read back from the cache
                mask = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
            mask = mask.repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(
                qg[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                scale=scale,
            )[0]
            o = o.view(num_kv_heads, q_len, group, head_dim).permute(1, 0, 2, 3)
            out[plan.token_start : plan.token_end] = o.reshape(q_len, num_heads, head_dim)
        plan = self._decode
        if plan is not None:
            if plan.contiguous:
                q = query[plan.start : plan.end]
            else:
                q = query[plan.token_rows]
            if self._kernel_runs(q):
                if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
                    q = q.contiguous()
                o = self._cpu_kernel.paged_decode(
                    q, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale
                )
                if plan.contiguous:
                    out[plan.start : plan.end] = o
                else:
                    out[plan.token_rows] = o
                return out
            batch = q.shape[0]
            # [Bd, max_blocks, block, KVH, D] -> [Bd, KVH, ctx, D]
            k = k_cache[plan.block_ids].flatten(1, 2).transpose(1, 2)
            v = v_cache[plan.block_ids].flatten(1, 2).transpose(1, 2)
            qg = q.view(batch, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask, scale=scale)
            o = o.reshape(batch, num_heads, head_dim)
            if plan.contiguous:
                out[plan.start : plan.end] = o
            else:
                out[plan.token_rows] = o
        return out

    def _kernel_runs(self, query: torch.Tensor) -> bool:
        return (
            bool(self._use_cpu_kernel)
            and self._cpu_kernel is not None
            and query.device.type == "cpu"
        )


def _write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows`` ([T, KVH, D]) into ``cache``'s flat slots, in any layout: a contiguous cache as
    a flat index copy, a permuted one (token-minor or head-major) through its view."""
    if cache.is_contiguous():
        cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slot_mapping, rows)
    else:
        block_size = cache.shape[1]
        cache[slot_mapping // block_size, slot_mapping % block_size] = rows
