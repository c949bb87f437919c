"""A C++ paged decode-attention kernel for the CPU path, compiled once with the system compiler.

Decode dominates serving, and on a CPU the torch path pays for attention three times: gather
the keys and values out of the paged cache into padded tensors, then let SDPA read them again.
This kernel reads each cached key and value exactly once, straight through the block table,
for all query heads of a KV group together (GQA), accumulating in float32.

It is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (about 30 s, cached
under ``~/.cache/torch_extensions``). Where no compiler is available, or with
``PREFIXMESH_CPU_KERNELS=0``, ``load()`` returns ``None`` and the torch path is used.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// One (sequence, KV head) per work item; D is a compile-time constant so the inner loops
// vectorize. Keys and values are read once each, through the block table.
template <typename T, int D>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int32_t* tables,
                          const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kvh = item % KVH;
      const int64_t len = lens[b];
      scores.resize(G * len);
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(b * H + kvh * G + g) * D + d]) * scale;
      const int32_t* table = tables + b * max_blocks;
      for (int64_t t = 0; t < len; ++t) {
        const T* k = kc + ((int64_t(table[t / BS]) * BS + t % BS) * KVH + kvh) * D;
        float kf[D];
#pragma omp simd
        for (int d = 0; d < D; ++d) kf[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = &qf[g * D];
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = &scores[g * len];
        float m = -INFINITY;
        for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* v = vc + ((int64_t(table[t / BS]) * BS + t % BS) * KVH + kvh) * D;
        float vf[D];
#pragma omp simd
        for (int d = 0; d < D; ++d) vf[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* a = &acc[g * D];
#pragma omp simd
          for (int d = 0; d < D; ++d) a[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          out[(b * H + kvh * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

template <typename T>
static void dispatch_d(torch::Tensor& q, torch::Tensor& kc, torch::Tensor& vc, torch::Tensor& bt,
                       torch::Tensor& lens, torch::Tensor& out, float scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kc.size(1), KVH = kc.size(2), MB = bt.size(1);
  auto args = std::make_tuple(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(),
                              bt.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<T>());
  auto [qp, kp, vp, tp, lp, op] = args;
  switch (D) {
    case 64: decode_kernel<T, 64>(qp, kp, vp, tp, lp, op, B, H, KVH, BS, MB, scale); break;
    case 128: decode_kernel<T, 128>(qp, kp, vp, tp, lp, op, B, H, KVH, BS, MB, scale); break;
    case 96: decode_kernel<T, 96>(qp, kp, vp, tp, lp, op, B, H, KVH, BS, MB, scale); break;
    case 32: decode_kernel<T, 32>(qp, kp, vp, tp, lp, op, B, H, KVH, BS, MB, scale); break;
    case 16: decode_kernel<T, 16>(qp, kp, vp, tp, lp, op, B, H, KVH, BS, MB, scale); break;
    default: TORCH_CHECK(false, "head_dim must be 16, 32, 64, 96 or 128");
  }
}

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous());
  auto out = torch::empty_like(query);
  const float s = static_cast<float>(scale);
  switch (query.scalar_type()) {
    case at::kFloat: dispatch_d<float>(query, k_cache, v_cache, block_tables, seq_lens, out, s); break;
    case at::kBFloat16: dispatch_d<at::BFloat16>(query, k_cache, v_cache, block_tables, seq_lens, out, s); break;
    case at::kHalf: dispatch_d<at::Half>(query, k_cache, v_cache, block_tables, seq_lens, out, s); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}
"""

_lock = threading.Lock()
_module = None
_tried = False


def load():
    """The compiled module (``paged_decode``), or ``None`` when it cannot be built here."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("PREFIXMESH_CPU_KERNELS", "1") == "0":
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            _module = load_inline(
                "prefixmesh_cpu_decode_v2",
                cpp_sources=_SOURCE,
                functions=["paged_decode"],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers: the torch path still works
            log.warning("CPU decode kernel unavailable (%s); using the torch path", exc)
            _module = None
        return _module


def paged_decode(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:
    module = load()
    assert module is not None, "call load() first and fall back when it returns None"
    return module.paged_decode(query, k_cache, v_cache, block_tables, seq_lens, scale)
