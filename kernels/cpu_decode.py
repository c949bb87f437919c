"""A C++ paged decode-attention kernel for the CPU path, compiled once with the system compiler.

Decode dominates serving, and on a CPU the torch path pays for attention three times: gather
the keys and values out of the paged cache into padded tensors, then let SDPA read them again.
This kernel reads each cached key and value exactly once, straight through the block table,
for all query heads of a KV group together (GQA), accumulating in float32. On AVX2 CPUs it
runs SmolLM2's decode attention for 64 sequences in ~2 ms per layer in float32 (the plain-loop
version it replaced took ~7.6 ms; memory bandwidth bounds it at ~1 ms).

It is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (about 30 s, cached
under ``~/.cache/torch_extensions``); ``PREFIXMESH_CPU_KERNEL_ISA=generic`` builds the plain-loop
branch even where AVX2 is available (for tests). Where no compiler is available, or with
``PREFIXMESH_CPU_KERNELS=0``, ``load()`` returns ``None`` and the torch path is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading

import torch

from kernels.cpu_flags import cpu_flags

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PM_AVX2 1
#endif

// Paged decode attention straight through the block table, accumulating in float32. Two ways
// to split the work: one sequence per work item (all its heads; rows stream front to back) when
// there are enough sequences to keep every thread busy, else one (sequence, KV head) per item
// with the G = H / KVH query heads of that KV head together. Either way each cached key and
// value is read from memory once. With AVX2 + FMA the loops are written with intrinsics (and a
// vector exp); elsewhere plain loops the compiler vectorizes as it can.

#ifdef PM_AVX2
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {  // bf16 -> f32 is a 16-bit shift
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// exp(x) for x <= 0 (Cephes expf: Cody-Waite range reduction, degree-6 polynomial; ~1 ulp).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // exp(-87) ~ 1.6e-38: keeps 2^n normal
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// q . k for one head: k already in V registers, q (float32) in memory; two accumulators.
template <int V>
static inline float dot(const __m256* kv, const float* q) {
  static_assert(V >= 2 && V % 2 == 0, "head_dim must be a multiple of 16");
  __m256 a0 = _mm256_mul_ps(kv[0], _mm256_loadu_ps(q));
  __m256 a1 = _mm256_mul_ps(kv[1], _mm256_loadu_ps(q + 8));
  for (int i = 2; i + 1 < V; i += 2) {
    a0 = _mm256_fmadd_ps(kv[i], _mm256_loadu_ps(q + 8 * i), a0);
    a1 = _mm256_fmadd_ps(kv[i + 1], _mm256_loadu_ps(q + 8 * i + 8), a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// Softmax of s[0..len) in place (normalized).
static inline void softmax_row(float* s, int64_t len) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = *std::max_element(lanes, lanes + 8);
  for (; t < len; ++t) m = std::max(m, s[t]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum8(sv);
  for (; t < len; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
  for (; t < len; ++t) s[t] *= 1.f / sum;
}

template <typename T, int D>
static void decode_item(const float* qf, const T* kc, const T* vc, const int32_t* table,
                        int64_t len, int64_t G, int64_t BS, int64_t row_stride, float* scores,
                        float* acc) {
  constexpr int V = D / 8;
  for (int64_t t = 0; t < len; ++t) {
    const T* k = kc + (int64_t(table[t / BS]) * BS + t % BS) * row_stride;
    __m256 kv[V];
    for (int i = 0; i < V; ++i) kv[i] = load8(k + 8 * i);
    for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot<V>(kv, qf + g * D);
  }
  for (int64_t g = 0; g < G; ++g) softmax_row(scores + g * len, len);
  // Weighted sum of values, up to 64 dims at a time (8 accumulators stay in registers).
  constexpr int C = D % 64 == 0 ? 64 : (D % 32 == 0 ? 32 : D), CV = C / 8;
  for (int64_t g = 0; g < G; ++g) {
    const float* p = scores + g * len;
    for (int dc = 0; dc < D; dc += C) {
      __m256 a[CV];
      for (int i = 0; i < CV; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        const T* v = vc + (int64_t(table[t / BS]) * BS + t % BS) * row_stride + dc;
        const __m256 pb = _mm256_set1_ps(p[t]);
        for (int i = 0; i < CV; ++i) a[i] = _mm256_fmadd_ps(pb, load8(v + 8 * i), a[i]);
      }
      for (int i = 0; i < CV; ++i) _mm256_storeu_ps(acc + g * D + dc + 8 * i, a[i]);
    }
  }
}

// All heads of one sequence per work item: each token's whole K row (every KV head) and then
// its whole V row are read once, front to back, so memory streams block by block.
template <typename T, int D>
static void decode_seq(const float* qf, const T* kc, const T* vc, const int32_t* table,
                       int64_t len, int64_t KVH, int64_t G, int64_t BS, float* scores,
                       float* acc) {
  constexpr int V = D / 8;
  const int64_t H = KVH * G, row = KVH * D;
  constexpr int64_t AHEAD = 8;
  // Token t's row (all KV heads) in a cache; with the row AHEAD tokens later prefetched.
  auto row_at = [&](const T* base, int64_t t) {
    const int64_t u = t + AHEAD;
    if (u < len) {
      const char* p = reinterpret_cast<const char*>(base + (int64_t(table[u / BS]) * BS + u % BS) * row);
      for (int64_t off = 0; off < row * int64_t(sizeof(T)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
    return base + (int64_t(table[t / BS]) * BS + t % BS) * row;
  };
  __m256 kv[V];
  for (int64_t t = 0; t < len; ++t) {
    const T* k = row_at(kc, t);
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int i = 0; i < V; ++i) kv[i] = load8(k + kvh * D + 8 * i);
      for (int64_t g = 0; g < G; ++g)
        scores[(kvh * G + g) * len + t] = dot<V>(kv, qf + (kvh * G + g) * D);
    }
  }
  for (int64_t h = 0; h < H; ++h) softmax_row(scores + h * len, len);
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const T* v = row_at(vc, t);
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int i = 0; i < V; ++i) kv[i] = load8(v + kvh * D + 8 * i);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const __m256 pb = _mm256_set1_ps(scores[h * len + t]);
        float* a = acc + h * D;
        for (int i = 0; i < V; ++i)
          _mm256_storeu_ps(a + 8 * i, _mm256_fmadd_ps(pb, kv[i], _mm256_loadu_ps(a + 8 * i)));
      }
    }
  }
}
#else
template <typename T, int D>
static void decode_item(const float* qf, const T* kc, const T* vc, const int32_t* table,
                        int64_t len, int64_t G, int64_t BS, int64_t row_stride, float* scores,
                        float* acc) {
  for (int64_t t = 0; t < len; ++t) {
    const T* k = kc + (int64_t(table[t / BS]) * BS + t % BS) * row_stride;
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += qf[g * D + d] * static_cast<float>(k[d]);
      scores[g * len + t] = s;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * len;
    float m = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
    for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
    for (int64_t t = 0; t < len; ++t) s[t] /= sum;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const T* v = vc + (int64_t(table[t / BS]) * BS + t % BS) * row_stride;
    for (int64_t g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) acc[g * D + d] += scores[g * len + t] * static_cast<float>(v[d]);
  }
}
#endif

template <typename T, int D>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int32_t* tables,
                          const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
#ifdef PM_AVX2
  if (B >= 4 * at::get_num_threads()) {
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(H * D), acc(H * D), scores;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t len = lens[b];
        scores.resize(H * len);
        for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(q[b * H * D + i]) * scale;
        decode_seq<T, D>(qf.data(), kc, vc, tables + b * max_blocks, len, KVH, G, BS, scores.data(), acc.data());
        for (int64_t i = 0; i < H * D; ++i) out[b * H * D + i] = static_cast<T>(acc[i]);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kvh = item % KVH;
      const int64_t len = lens[b];
      scores.resize(G * len);
      const T* qb = q + (b * H + kvh * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qb[i]) * scale;
      decode_item<T, D>(qf.data(), kc + kvh * D, vc + kvh * D, tables + b * max_blocks, len, G,
                        BS, KVH * D, scores.data(), acc.data());
      T* ob = out + (b * H + kvh * G) * D;
      for (int64_t i = 0; i < G * D; ++i) ob[i] = static_cast<T>(acc[i]);
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

// Which branch this build compiled: "avx2" (intrinsics) or "generic" (plain loops).
std::string isa() {
#ifdef PM_AVX2
  return "avx2";
#else
  return "generic";
#endif
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

            # -fopenmp: at::parallel_for only splits work across threads in a translation unit
            # built with OpenMP; the extension then shares torch's own libgomp (same soname), so
            # torch.set_num_threads governs it too. The name carries a digest of the source and
            # of this CPU's flags: a build for another CPU (-march=native) is never reused.
            _module = load_inline(
                f"prefixmesh_cpu_decode_{_build_tag()}",
                cpp_sources=_SOURCE,
                functions=["paged_decode", "isa"],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp", *_isa_flags()],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers: the torch path still works
            log.warning("CPU decode kernel unavailable (%s); using the torch path", exc)
            _module = None
        return _module


def _isa_flags() -> list[str]:
    """``PREFIXMESH_CPU_KERNEL_ISA=generic`` builds the plain-loop branch on an x86 CPU that has
    AVX2 (what ARM and pre-AVX2 CPUs always get), so tests can check that branch anywhere."""
    if os.environ.get("PREFIXMESH_CPU_KERNEL_ISA", "native") != "generic":
        return []
    return ["-mno-avx2", "-mno-fma"] if platform.machine() in ("x86_64", "AMD64") else []


def _build_tag() -> str:
    flags = " ".join([*_isa_flags(), *sorted(cpu_flags() or ())])
    return hashlib.sha1((_SOURCE + flags).encode()).hexdigest()[:12]


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
