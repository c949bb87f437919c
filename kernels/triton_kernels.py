"""Triton kernels for the paged KV cache: store new keys/values, and varlen paged attention.

The kernel bodies are plain functions compiled on demand by :func:`get_kernels`, once for the GPU
(``triton.jit``) and once for the CPU interpreter, so the choice follows the tensors' device
rather than whether ``TRITON_INTERPRET`` happened to be set when this module was imported.

Attention layout (one launch serves prefill chunks, plain prefills and decodes together):

* Grid ``(num_q_blocks, num_kv_heads, num_splits)``. A *query block* is up to ``BLOCK_Q``
  consecutive new tokens of one sequence; the host lists them in ``q_block_seq`` /
  ``q_block_idx`` (built once per step from the host copies of the query lengths).
* A program holds ``BLOCK_M = BLOCK_Q * GROUP`` query rows: every query head of one KV head's
  group for each of its tokens (row ``r`` is token ``r // GROUP``, head ``r % GROUP``), so each
  key/value tile is loaded once per group (GQA) and fed to ``tl.dot``.
* It walks the sequence's context in tiles of ``TILE_N`` positions, gathering each position's
  physical slot through the block table (so any block size works, not only powers of two), with
  an online softmax accumulated in float32. Keys are visible when ``pos <= cached_len + i`` for
  new token ``i``: full over the cached prefix, causal within the new tokens.
* With ``num_splits > 1`` (flash-decoding for long contexts and few programs) each split covers
  a contiguous range of tiles and writes unnormalised partials; :func:`_merge_splits_fn`
  combines them.
"""

from __future__ import annotations

import functools
import os
import types
from dataclasses import dataclass

import triton.language as tl

# Triton 3.9 warns that its default for fusing a*b+c into FMAs changes in 3.10. The kernels were
# validated against the torch path with fusion on (more accurate, and faster): keep it on
# explicitly, unless the user chose.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

# The kernels call only Triton builtins, never the @jit helpers of triton.language.standard
# (tl.max, tl.sum, tl.cdiv, tl.zeros): those are built for one mode (GPU or interpreter) when
# triton is first imported, which depends on whether TRITON_INTERPRET was set by then
# (transformers imports triton early). Reductions go through tl.reduce with the combine
# functions ``_MAX`` and ``_SUM``, which get_kernels binds per mode (see there).


def _max_combine(a, b):
    return tl.maximum(a, b)


def _sum_combine(a, b):
    return a + b


# Placeholders: every kernel that reduces is a copy bound to the mode's pair (get_kernels).
_MAX = None
_SUM = None


def _store_kv_fn(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64; negative = padding token, skipped
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per new token: copy its ``[KVH, D]`` key and value into the cache slot."""
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        tok64 = tok.to(tl.int64)
        k = tl.load(
            key_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
            mask=mask,
        )
        v = tl.load(
            value_ptr
            + tok64 * stride_vt
            + offs_h[:, None] * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=mask,
        )
        k_dst = (
            k_cache_ptr
            + blk * stride_cb
            + off * stride_cs
            + offs_h[:, None] * stride_ch
            + offs_d[None, :] * stride_cd
        )
        v_dst = (
            v_cache_ptr
            + blk * stride_vcb
            + off * stride_vcs
            + offs_h[:, None] * stride_vch
            + offs_d[None, :] * stride_vcd
        )
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _paged_attention_fn(
    out_ptr,  # [T, H, D] (NUM_SPLITS == 1)
    part_acc_ptr,  # [T, H, NUM_SPLITS, D] float32 (NUM_SPLITS > 1)
    part_ml_ptr,  # [T, H, NUM_SPLITS, 2] float32: running max (log2 domain) and sum
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    q_block_seq_ptr,  # [num_q_blocks] int32: sequence of each query block
    q_block_idx_ptr,  # [num_q_blocks] int32: index of the block within its sequence
    scale_log2,  # softmax scale * log2(e)
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, >= BLOCK_Q * GROUP, power of two
    TILE_N: tl.constexpr,  # context positions per inner step, power of two
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, else "tf32" (unused for 16-bit)
    UPCAST_DOT: tl.constexpr,  # dot in float32: the interpreter's bfloat16 tl.dot is wrong
):
    """Online-softmax attention of one query block and one KV-head group over its context."""
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(q_block_seq_ptr + qb)
    q_block = tl.load(q_block_idx_ptr + qb)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    cached_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok_in_seq = q_block * BLOCK_Q + offs_m // GROUP  # index among the sequence's new tokens
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (tok_in_seq < q_len)
    d_valid = offs_d < HEAD_DIM
    tok = (q_start + tok_in_seq).to(tl.int64)

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    # The last position any row of this block may see (causal bound of its last token).
    last_tok = tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    kv_end = cached_len + last_tok + 1
    num_tiles = (kv_end + TILE_N - 1) // TILE_N
    tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    visible_end = cached_len + tok_in_seq  # inclusive bound per row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n
        pos_valid = pos < kv_end
        phys = tl.load(bt_row + pos // block_size, mask=pos_valid, other=0).to(tl.int64)
        in_blk = (pos % block_size).to(tl.int64)
        kv_mask = pos_valid[:, None] & d_valid[None, :]
        k = tl.load(
            k_cache_ptr
            + phys[:, None] * stride_kb
            + in_blk[:, None] * stride_ks
            + kv_head * stride_kh
            + offs_d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + phys[:, None] * stride_vb
            + in_blk[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )
        p_dtype = v.dtype  # probabilities are rounded to the cache dtype, as on the GPU
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = row_valid[:, None] & (pos[None, :] <= visible_end[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        # Rows with nothing visible yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(p_dtype).to(v.dtype), v, input_precision=DOT_PRECISION
        )
        m_i = m_new

    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr
            + tok[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        part = (tok * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)


def _merge_splits_fn(
    out_ptr,  # [T, H, D]
    part_acc_ptr,  # [T, H, NUM_SPLITS, BLOCK_D] float32
    part_ml_ptr,  # [T, H, NUM_SPLITS, 2] float32
    stride_ot,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
):
    """One program per (token, head): rescale each split's partial sums to a common max."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < NUM_SPLITS
    base = (tok * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + base * 2, mask=s_valid, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + base * 2 + 1, mask=s_valid, other=0.0)
    acc = tl.load(
        part_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :],
        mask=s_valid[:, None],
        other=0.0,
    )
    m_max = tl.reduce(m, 0, _MAX)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # empty splits have m = -inf, so weight 0
    total = tl.reduce(lsum * w, 0, _SUM)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.reduce(acc * w[:, None], 0, _SUM) / total
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@dataclass(frozen=True)
class Kernels:
    """The three kernels compiled for one execution mode (GPU or interpreter)."""

    store_kv: object
    paged_attention: object
    merge_splits: object


def _with_globals(fn, **overrides):
    """A copy of ``fn`` whose global names ``overrides`` are bound to other objects."""
    scope = dict(fn.__globals__, **overrides)
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    # triton.jit reads which parameters are tl.constexpr from the annotations, which
    # FunctionType does not copy: without them every constexpr becomes a runtime argument (the
    # interpreter does not mind; compiled kernels fail on the string DOT_PRECISION).
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


@functools.cache
def get_kernels(interpret: bool) -> Kernels:
    """Kernels for the GPU (``interpret=False``) or Triton's CPU interpreter (``True``).

    Explicit classes rather than ``triton.jit``, which picks one from ``TRITON_INTERPRET``. The
    interpreter runs ``tl.reduce`` in numpy only with triton's own combine functions (else one
    Python call per element), so it gets those; compiled kernels get ours, compiled alike.
    """
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap

        combine = {"_MAX": tl.standard._elementwise_max, "_SUM": tl.standard._sum_combine}
    else:
        from triton.runtime.jit import JITFunction as wrap

        combine = {"_MAX": wrap(_max_combine), "_SUM": wrap(_sum_combine)}
    return Kernels(
        store_kv=wrap(_store_kv_fn),
        paged_attention=wrap(_with_globals(_paged_attention_fn, **combine)),
        merge_splits=wrap(_with_globals(_merge_splits_fn, **combine)),
    )
