// prefixmesh's CPU kernels: paged decode attention and the per-layer elementwise work, fused.
//
// Written once against ATen's portable vectors (at::vec::Vectorized<float>) and compiled once
// per ISA by kernels/cpu_ops.py: 8 floats a vector under AVX2, 16 under AVX-512, plain arrays
// the compiler vectorizes as it can on other CPUs. Everything accumulates in float32 and reads
// float32, bfloat16 or float16 tensors directly.
//
// Why fused: SmolLM2-sized layers are tiny (64 x 576 activations at decode), so torch's eager
// ops spend their time launching, allocating and re-reading memory, not computing. One call
// here replaces 4-10 of them: an RMSNorm with its residual add, RoPE with the KV-cache write,
// SiLU with its multiply.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "output.h"
#include "prefetch.h"

#if defined(PM_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t W = fVec::size();

// Rows per thread for the elementwise kernels: at least 16K elements, so a decode step of 64
// sequences (64 x 576 activations, 20-40 us of work a call) splits across two threads and a
// lone sequence's row stays on one. A fork and a barrier cost a few microseconds where the
// threads have cores of their own (the GEMMs pay them 121 times a step already); a replica
// that shares its cores runs with --threads 1, where nothing forks.
inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, (int64_t(1) << 14) / width); }

// ---------------------------------------------------------------- loads and stores as float
template <typename T>
inline fVec loadf(const T* p) {
  fVec v;
  at::vec::load_to_float<T>(p, v);
  return v;
}
template <>
inline fVec loadf<float>(const float* p) {
  return fVec::loadu(p);
}

template <typename T>
inline void storef(T* p, const fVec& v) {
  at::vec::convert_from_float<T>(v, v).store(p, W);
}
template <>
inline void storef<float>(float* p, const fVec& v) {
  v.store(p);
}

// v rounded to T's precision and back (a no-op for float): where the reference model stores an
// intermediate in T, so do we.
template <typename T>
inline fVec round_to(const fVec& v) {
  return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
}
template <>
inline fVec round_to<float>(const fVec& v) {
  return v;
}

// Pairs of vectors (2W elements) as float: a bfloat16/float16 store converts both halves at
// once, where storef converts a full register pair to keep one half.
template <typename T>
inline void load2(const T* p, fVec& a, fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + W);
  } else {
    at::vec::load_to_float<T>(p, a, b);
  }
}

template <typename T>
inline void store2(T* p, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + W);
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// a and b rounded to T's precision and back (a no-op for float).
template <typename T>
inline void round2(fVec& a, fVec& b) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
  }
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Sum of a vector's lanes (ATen's own reduce_add does not compile for the plain build).
inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
}

// Cache lines of `bytes` from p, asked for ahead of use. Rows of the paged cache come from
// scattered blocks, so the hardware prefetcher cannot see them coming; every line of a head's
// row is asked for 32 tokens ahead (about a memory latency of the kernel's work), and
// token-minor keys (see below) a whole block's run 4 blocks ahead.
constexpr int64_t PREFETCH_TOKENS = 32;
constexpr int64_t PREFETCH_BLOCKS = 4;
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) pm::prefetch(c + b);
}

// Offsets (in elements) of a sequence's first `len` tokens' rows in a paged cache whose blocks
// hold `block` elements, `step` elements from one token's row to the next within a block.
inline void token_rows(const int32_t* table, int64_t len, int64_t BS, int64_t block, int64_t step,
                       int64_t* out) {
  for (int64_t start = 0, b = 0; start < len; start += BS, ++b) {
    const int64_t base = int64_t(table[b]) * block, n = std::min(BS, len - start);
    for (int64_t j = 0; j < n; ++j) out[start + j] = base + j * step;
  }
}

// ---------------------------------------------------------------- cache layouts
// A layer's caches are [num_blocks, BS, KVH, D] tensors (kernels.interface.new_kv_cache) in one
// of three layouts, named for their keys:
//   rows:   keys and values contiguous, each token's KV heads one after another;
//   tokens: keys token-minor, the view of [num_blocks, KVH, D, BS] storage (see "keys in
//           token-minor order" below), values head-major;
//   heads:  keys and values head-major, the view of [num_blocks, KVH, BS, D] storage, so that
//           each (block, KV head)'s rows are one run of BS * D elements.
// Every block holds BS * KVH * D elements whatever the layout. Token j of a block, KV head h,
// sits at j * step + h * head past the block's start in rows and head-major caches.
struct KvLayout {
  int64_t kblock;  // > 0: token-minor keys, elements a block; 0: keys in rows, as the values
  int64_t step;    // from one token's row to the next in a block: KVH * D in rows, D head-major
  int64_t head;    // from one KV head's row to the next: D in rows, BS * D head-major
};

bool is_head_major(const at::Tensor& c) {
  const int64_t BS = c.size(1), KVH = c.size(2), D = c.size(3);
  return c.stride(3) == 1 && c.stride(1) == D && c.stride(2) == BS * D &&
         (c.size(0) == 1 || c.stride(0) == KVH * BS * D);
}

bool is_token_minor(const at::Tensor& c) {
  const int64_t BS = c.size(1), KVH = c.size(2), D = c.size(3);
  return c.stride(1) == 1 && c.stride(3) == BS && c.stride(2) == D * BS &&
         (c.size(0) == 1 || c.stride(0) == KVH * D * BS);
}

// The layout of a (k_cache, v_cache) pair; anything else, or keys and values in different
// layouts, is refused with an error naming the layouts.
KvLayout check_kv_layout(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(v.sizes() == k.sizes(), "k_cache and v_cache must have the same shape");
  const int64_t BS = k.size(1), KVH = k.size(2), D = k.size(3);
  const char* made = " (kernels.interface.new_kv_cache makes each layout)";
  if (k.is_contiguous()) {
    TORCH_CHECK(v.is_contiguous(), "with keys in rows, v_cache must be contiguous", made);
    return {0, KVH * D, D};
  }
  const bool tokens = is_token_minor(k);
  TORCH_CHECK(tokens || is_head_major(k),
              "k_cache must be contiguous (rows), token-minor (the [num_blocks, block_size, "
              "num_kv_heads, head_dim] view of [num_blocks, num_kv_heads, head_dim, block_size] "
              "storage) or head-major (the view of [num_blocks, num_kv_heads, block_size, "
              "head_dim] storage)", made);
  TORCH_CHECK(is_head_major(v), "with ", tokens ? "token-minor" : "head-major",
              " keys, v_cache must be head-major in each block: the [num_blocks, block_size, "
              "num_kv_heads, head_dim] view of [num_blocks, num_kv_heads, block_size, head_dim] "
              "storage", made);
  if (tokens)
    TORCH_CHECK(BS % W == 0, "token-minor keys need block_size to be a multiple of ", W,
                " (this build's vector width), got ", BS);
  return {tokens ? KVH * D * BS : 0, D, BS * D};
}

// ---------------------------------------------------------------- paged decode attention
// One query token per sequence, attending to its whole context through its block table.
// A work item is one sequence and a range of its KV heads. For each KV head, a first pass
// reads every cached key once and scores the G query heads that share it (GQA); a softmax;
// a second pass reads every cached value once and accumulates the G outputs. Heads are taken
// GB at a time (a compile-time count, so their accumulators stay in registers) and head_dim
// CH vectors at a time; the rows come from memory in the first of these passes, then from
// cache.

// exp in float32 to within 1 ulp (0.94 measured; 1.21 in the generic build, whose multiply-adds
// round twice), inline: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, the first exact in
// 16 bits, so n * ln2_hi is exact), exp(r) by its Taylor series to r^7 (the next term is below
// 1e-8 relative), times 2^n set in the exponent bits. Below -87.33 it returns 0 (the exact
// value is a denormal under 1.2e-38), above 88.37 infinity (the exact value is within a factor
// 1.4 of FLT_MAX): for the softmax's numerators and SiLU's 1 / (1 + exp(-x)) neither changes a
// result beyond 1e-36. NaN stays NaN.
// Sleef's exp (ATen's Vectorized::exp) is a function call, which makes a loop around it keep
// its vectors in memory (every vector register is caller-saved): SiLU over a decode step's
// [64, 3072] -> [64, 1536] ran 1.6x faster with this one (docs/benchmarks.md). Sleef's is
// within 0.57 ulp, and SiLU no longer matches torch's float32 SiLU bit for bit (greedy outputs
// still match Hugging Face's; the tests bound the exp against float64's).
inline fVec exp_f32(const fVec& x) {
  const fVec lo(-87.33654f), hi(88.37626f);  // 2^-126 and 2^127.5: n stays in [-126, 127]
  const fVec xc = at::vec::clamp(x, lo, hi);
  const fVec n = (xc * fVec(1.44269504088896341f)).round();
  fVec r = at::vec::fnmadd(n, fVec(0.693145751953125f), xc);
  r = at::vec::fnmadd(n, fVec(1.42860682030941723212e-6f), r);
  fVec p = at::vec::fmadd(fVec(1.f / 5040), r, fVec(1.f / 720));
  p = at::vec::fmadd(p, r, fVec(1.f / 120));
  p = at::vec::fmadd(p, r, fVec(1.f / 24));
  p = at::vec::fmadd(p, r, fVec(1.f / 6));
  p = at::vec::fmadd(p, r, fVec(0.5f));
  p = at::vec::fmadd(p, r, fVec(1.f));
  p = at::vec::fmadd(p, r, fVec(1.f));
  using iVec = at::vec::Vectorized<int32_t>;
  const iVec bits = (at::vec::convert_to_int_of_same_size(n) + iVec(127)) << iVec(23);
  fVec y = p * at::vec::cast<float>(bits);
  y = fVec::blendv(y, fVec(0.f), x < lo);
  y = fVec::blendv(y, fVec(std::numeric_limits<float>::infinity()), x > hi);
  return fVec::blendv(y, x, x != x);
}

// exp for the softmax and SiLU: exp_f32 in float32, ATen's faster polynomial where the tensors
// are bfloat16/float16 anyway.
template <typename T>
inline fVec exp_for(const fVec& x) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_f32(x);
  } else {
    return x.exp_u20();
  }
}

// Scores of GB query heads against every cached key of one KV head.
template <typename T, int D, int GB>
inline void score_heads(const fVec* qv, const T* kc, const int64_t* rows, int64_t len,
                        int64_t off, float* scores, int64_t stride) {
  constexpr int V = D / W;
  for (int64_t t = 0; t < len; ++t) {
    if (t + PREFETCH_TOKENS < len)
      prefetch_span(kc + rows[t + PREFETCH_TOKENS] + off, D * sizeof(T));
    const T* k = kc + rows[t] + off;
    fVec kv[V];
    for (int i = 0; i < V; ++i) kv[i] = loadf(k + i * W);
    for (int g = 0; g < GB; ++g) {
      // Two accumulators: half the dependency chain.
      fVec a = kv[0] * qv[g * V], b = V > 1 ? kv[1] * qv[g * V + 1] : fVec(0.f);
      for (int i = 2; i + 1 < V; i += 2) {
        a = at::vec::fmadd(kv[i], qv[g * V + i], a);
        b = at::vec::fmadd(kv[i + 1], qv[g * V + i + 1], b);
      }
      if constexpr (V % 2 == 1 && V > 1) a = at::vec::fmadd(kv[V - 1], qv[g * V + V - 1], a);
      scores[g * stride + t] = hsum(a + b);
    }
  }
}

// out[g] = sum_t p[g][t] * v[t] for GB heads, CH vectors of head_dim per pass.
template <typename T, int D, int GB>
inline void weigh_values(const float* scores, const float* inv_sum, const T* vc,
                         const int64_t* rows, int64_t len, int64_t off, T* out,
                         int64_t stride) {
  constexpr int V = D / W;
  // Up to 12 accumulators: they and the loaded values fit the 16 AVX2 registers.
  constexpr int CAP = std::max(1, 12 / GB);
  constexpr int CH = V % 4 == 0 && CAP >= 4 ? 4 : (V % 2 == 0 && CAP >= 2 ? 2 : 1);
  for (int c = 0; c < V; c += CH) {
    fVec acc[GB][CH];
    for (int g = 0; g < GB; ++g)
      for (int i = 0; i < CH; ++i) acc[g][i] = fVec(0.f);
    for (int64_t t = 0; t < len; ++t) {
      if (c == 0 && t + PREFETCH_TOKENS < len)
        prefetch_span(vc + rows[t + PREFETCH_TOKENS] + off, D * sizeof(T));
      const T* v = vc + rows[t] + off + c * W;
      fVec vv[CH];
      for (int i = 0; i < CH; ++i) vv[i] = loadf(v + i * W);
      for (int g = 0; g < GB; ++g) {
        const fVec p(scores[g * stride + t]);
        for (int i = 0; i < CH; ++i) acc[g][i] = at::vec::fmadd(p, vv[i], acc[g][i]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      const fVec norm(inv_sum[g]);
      for (int i = 0; i < CH; ++i) storef(out + g * D + (c + i) * W, acc[g][i] * norm);
    }
  }
}

// Softmax numerators in place over a row of whole vectors (padded with -inf) whose largest
// value is known; returns 1 / their sum.
template <typename T>
inline float softmax_row_padded(float* s, int64_t stride, float max) {
  fVec sum(0.f);
  const fVec mv(max);
  for (int64_t t = 0; t < stride; t += W) {
    const fVec e = exp_for<T>(fVec::loadu(s + t) - mv);
    e.store(s + t);
    sum = sum + e;
  }
  return 1.f / hsum(sum);
}

// Softmax numerators in place of a row's first `len` scores, taken over whole vectors: the
// scores from len up to `padded` (len rounded up to the vector width, within the row) are set
// to -inf first, so their numerators are 0 and no element is left to a scalar tail. A row of a
// few hundred scores otherwise spends as long on its last few elements' scalar exps as on the
// rest. Returns 1 / the numerators' sum.
template <typename T>
inline float softmax_padded(float* s, int64_t len, int64_t padded) {
  const float inf = std::numeric_limits<float>::infinity();
  std::fill(s + len, s + padded, -inf);
  fVec mx(-inf);
  for (int64_t t = 0; t < padded; t += W) mx = at::vec::maximum(mx, fVec::loadu(s + t));
  const float m = at::vec::vec_reduce_all<float>(
      [](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, mx);
  return softmax_row_padded<T>(s, padded, m);
}

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

template <typename T, int D, int GB>
void attend_heads(const fVec* qv, const T* kc, const T* vc, const int64_t* rows, int64_t len,
                  int64_t off, float* scores, T* out) {
  const int64_t stride = round_up(len, W);  // the caller's buffer rows are whole tiles
  score_heads<T, D, GB>(qv, kc, rows, len, off, scores, stride);
  float inv_sum[GB];
  for (int g = 0; g < GB; ++g) inv_sum[g] = softmax_padded<T>(scores + g * stride, len, stride);
  weigh_values<T, D, GB>(scores, inv_sum, vc, rows, len, off, out, stride);
}

// ---------------------------------------------------------------- keys in token-minor order
// The key cache can also be kept token-minor: stored [blocks, KVH, D, BS] and handed to torch as
// a permuted view of shape [blocks, BS, KVH, D] (kernels.interface.new_kv_cache), so that one
// dimension of a block's BS tokens is contiguous. A vector then holds that dimension for W
// tokens, and W scores are D FMAs of the broadcast query element against it: no sum across a
// vector's lanes, which is what the row layout's scores spend most of their time on
// (docs/benchmarks.md). Values stay in rows: the weighted sum broadcasts a probability against
// a row of head_dim either way. Each (block, KV head)'s keys are one contiguous run of D * BS.
//
// Registers: GB heads x TU token vectors of accumulators, TU loaded keys and one broadcast
// query element, within the 16 (AVX2) or 32 (AVX-512) vector registers.
constexpr int VREGS = W >= 16 ? 32 : 16;
template <int GB>
constexpr int token_unroll() {
  return std::max(1, std::min(4, (VREGS - 4) / (GB + 1)));
}

// scores[g][v * W + j] for TU token vectors v = first..first + TU - 1: tv[v] points at dimension
// 0 of those W tokens (dimension d is BS elements further on).
// Not inlined: inside the caller's loops GCC keeps the accumulators of the shorter tails on
// the stack, a store and a load per FMA.
template <typename T, int D, int GB, int TU>
__attribute__((noinline)) void score_token_vectors(const float* q, const T* const* tv, int64_t first, int64_t BS,
                                int64_t off, float* scores, int64_t stride) {
  fVec acc[GB][TU];
  for (int g = 0; g < GB; ++g)
    for (int u = 0; u < TU; ++u) acc[g][u] = fVec(0.f);
  const T* k[TU];
  for (int u = 0; u < TU; ++u) k[u] = tv[first + u] + off;
  for (int d = 0; d < D; ++d) {
    fVec kv[TU];
    for (int u = 0; u < TU; ++u) kv[u] = loadf(k[u] + d * BS);
    for (int g = 0; g < GB; ++g) {
      const fVec qd(q[g * D + d]);
      for (int u = 0; u < TU; ++u) acc[g][u] = at::vec::fmadd(qd, kv[u], acc[g][u]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int u = 0; u < TU; ++u) acc[g][u].store(scores + g * stride + (first + u) * W);
}

// Scores of GB query heads (q: [GB][D] floats, already scaled) against the nv token vectors of
// one KV head (at `off` elements past each pointer). Each block's run of keys is asked for
// PREFETCH_BLOCKS blocks ahead: blocks are scattered, so the hardware prefetcher cannot see
// them coming.
template <typename T, int D, int GB>
inline void score_heads_tokens(const float* q, const T* const* tv, int64_t nv, int64_t BS,
                               int64_t off, float* scores, int64_t stride) {
  constexpr int TU = token_unroll<GB>();
  const int64_t per_block = BS / W, ahead = PREFETCH_BLOCKS * per_block;
  int64_t v = 0;
  for (; v + TU <= nv; v += TU) {
    for (int u = 0; u < TU; ++u)
      if ((v + u) % per_block == 0 && v + u + ahead < nv)
        prefetch_span(tv[v + u + ahead] + off, D * BS * sizeof(T));
    score_token_vectors<T, D, GB, TU>(q, tv, v, BS, off, scores, stride);
  }
  // The last nv % TU vectors, in one call (TU is at most 4).
  switch (nv - v) {
    case 3: if constexpr (TU > 3) score_token_vectors<T, D, GB, 3>(q, tv, v, BS, off, scores, stride); break;
    case 2: if constexpr (TU > 2) score_token_vectors<T, D, GB, 2>(q, tv, v, BS, off, scores, stride); break;
    case 1: score_token_vectors<T, D, GB, 1>(q, tv, v, BS, off, scores, stride); break;
    default: break;
  }
}

// attend_heads for token-minor keys (values in rows, as always).
template <typename T, int D, int GB>
void attend_heads_tokens(const float* q, const T* const* tv, int64_t nv, int64_t BS,
                         int64_t k_off, const T* vc, const int64_t* rows, int64_t len,
                         int64_t v_off, float* scores, T* out) {
  const int64_t stride = nv * W;  // = len rounded up to whole vectors
  score_heads_tokens<T, D, GB>(q, tv, nv, BS, k_off, scores, stride);
  float inv_sum[GB];
  for (int g = 0; g < GB; ++g) inv_sum[g] = softmax_padded<T>(scores + g * stride, len, stride);
  weigh_values<T, D, GB>(scores, inv_sum, vc, rows, len, v_off, out, stride);
}

// Pointers to dimension 0 of KV head 0 for each W tokens of a sequence's first `len` tokens in a
// token-minor key cache whose blocks hold `kblock` elements.
template <typename T>
inline void token_vectors(const T* kc, const int32_t* table, int64_t len, int64_t BS,
                          int64_t kblock, std::vector<const T*>& out) {
  const int64_t nv = (len + W - 1) / W, per_block = BS / W;
  out.resize(nv);
  for (int64_t v = 0; v < nv; ++v)
    out[v] = kc + int64_t(table[v / per_block]) * kblock + (v % per_block) * W;
}

// ---------------------------------------------------------------- decode scores as tile products
// With bfloat16 caches, a KV head's scores against 16 keys are one tile product per 32
// dimensions: A = the 16 keys' rows, loaded straight from the paged cache (a strided tile load:
// no conversion to float, no transposition), B = the G query heads sharing that KV head in the
// tiles' pair layout (B[i][g][p] = q[g][32c + 2i + p], zero for g >= G), C = 16 x 16 float32
// sums whose first G columns are the scores. The FMA path scores one key at a time and sums
// every dot product across the vector's lanes, the step's largest cost after the reads
// (docs/benchmarks.md); on AMX the tile unit does both. `AmxTiles` exists in the AMX build
// only; `EmulatedTiles` does the same arithmetic in plain C++ (products in pairs, summed in
// float32) in every build, so the pair layout and the walk over blocks are tested on any CPU.
constexpr int TILE = 16;    // keys per tile product, and query-head columns
constexpr int TILE_K = 32;  // bfloat16 elements in a tile row (64 bytes)
using bf16 = at::BFloat16;

// How decode attention scores keys: chosen per call from this setting (see set_decode_scores).
enum class Scores { automatic, fma, amx, emulated };
std::atomic<int> g_scores{static_cast<int>(Scores::automatic)};

#if defined(PM_AMX)
// Linux hands out the tile registers' state only to a process that asks for it.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0: C; tmm1 and tmm6: A (alternating, so a load need not wait for the previous product);
// tmm2-tmm5: B, one per 32 dimensions (head_dim up to 128).
struct AmxTiles {
  void begin() {
    TileConfig cfg;
    for (int t = 0; t < 7; ++t) {
      cfg.rows[t] = TILE;
      cfg.colsb[t] = 64;
    }
    // GCC 12 does not see ldtilecfg read the rows and widths, and drops their stores.
    asm volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
  }
  void end() { _tile_release(); }
  template <int D>
  void set_queries(const bf16* b) {
    constexpr int C = D / TILE_K, STEP = TILE * TILE_K;
    _tile_loadd(2, b, 64);
    if constexpr (C > 1) _tile_loadd(3, b + STEP, 64);
    if constexpr (C > 2) _tile_loadd(4, b + 2 * STEP, 64);
    if constexpr (C > 3) _tile_loadd(5, b + 3 * STEP, 64);
  }
  template <int D>
  void score(const bf16* a, int64_t stride, float* c) {
    constexpr int C = D / TILE_K;
    const int64_t bytes = stride * static_cast<int64_t>(sizeof(bf16));
    _tile_zero(0);
    _tile_loadd(1, a, bytes);
    if constexpr (C > 1) _tile_loadd(6, a + TILE_K, bytes);
    _tile_dpbf16ps(0, 1, 2);
    if constexpr (C > 1) _tile_dpbf16ps(0, 6, 3);
    if constexpr (C > 2) {
      _tile_loadd(1, a + 2 * TILE_K, bytes);
      _tile_dpbf16ps(0, 1, 4);
    }
    if constexpr (C > 3) {
      _tile_loadd(6, a + 3 * TILE_K, bytes);
      _tile_dpbf16ps(0, 6, 5);
    }
    _tile_stored(0, c, TILE * sizeof(float));
  }
};
#endif

struct EmulatedTiles {
  const bf16* b = nullptr;
  void begin() {}
  void end() {}
  template <int D>
  void set_queries(const bf16* packed) {
    b = packed;
  }
  template <int D>
  void score(const bf16* a, int64_t stride, float* c) {
    std::fill(c, c + TILE * TILE, 0.f);
    for (int ch = 0; ch < D / TILE_K; ++ch)
      for (int m = 0; m < TILE; ++m) {
        const bf16* row = a + m * stride + ch * TILE_K;
        for (int i = 0; i < TILE_K / 2; ++i) {
          const float a0 = row[2 * i], a1 = row[2 * i + 1];
          const bf16* pair = b + (ch * TILE + i) * TILE * 2;
          for (int n = 0; n < TILE; ++n)
            c[m * TILE + n] += a0 * static_cast<float>(pair[2 * n]) +
                               a1 * static_cast<float>(pair[2 * n + 1]);
        }
      }
  }
};

// One KV head's G queries as B tiles: [D / 32][16 pairs][16 heads][2], zero past G.
template <int D>
void pack_queries(const bf16* q, int64_t head_stride, int64_t G, bf16* b) {
  std::fill(b, b + D / TILE_K * TILE * TILE_K, bf16(0.f));
  for (int64_t g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) {
      const int ch = d / TILE_K, i = d % TILE_K / 2, p = d % 2;
      b[((ch * TILE + i) * TILE + g) * 2 + p] = q[g * head_stride + d];
    }
}

// scores[g][t] = scale * q[g] . k[t] for the G queries of one KV head, 16 keys per product,
// in rows of `stride` (len rounded up to 16) with -inf past len; max[g] = the row's largest.
// Blocks hold a multiple of 16 tokens, so a tile's 16 rows are always inside one block; a
// block is `block` elements, its key rows `step` apart (the head's first at `off`).
template <class Tiles, int D>
void score_by_tiles(Tiles& tiles, const bf16* kc, const int32_t* table, int64_t len,
                    int64_t BS, int64_t block, int64_t step, int64_t off, int64_t G,
                    float scale, float* scores, int64_t stride, float* max) {
  alignas(64) float c[TILE * TILE];
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) max[g] = -inf;
  for (int64_t start = 0, b = 0; start < len; start += BS, ++b) {
    const bf16* keys = kc + int64_t(table[b]) * block + off;
    if (start + BS < len) {  // the next block's rows of this head, one block ahead
      const bf16* next = kc + int64_t(table[b + 1]) * block + off;
      for (int64_t j = 0; j < std::min(BS, len - start - BS); ++j)
        prefetch_span(next + j * step, D * sizeof(bf16));
    }
    for (int64_t sub = 0; sub < BS && start + sub < len; sub += TILE) {
      tiles.template score<D>(keys + sub * step, step, c);
      const int64_t t0 = start + sub, n = std::min<int64_t>(TILE, len - t0);
      for (int64_t g = 0; g < G; ++g) {
        float* out = scores + g * stride + t0;
        float m = max[g];
        for (int64_t j = 0; j < n; ++j) {
          out[j] = c[j * TILE + g] * scale;
          m = std::max(m, out[j]);
        }
        for (int64_t j = n; j < TILE; ++j) out[j] = -inf;
        max[g] = m;
      }
    }
  }
}

// The rest of attend_item for one sequence when its scores come from tiles.
template <class Tiles, int D>
void attend_item_tiles(Tiles tiles, const bf16* q, int64_t q_head_stride, const bf16* kc,
                       const bf16* vc, const int32_t* table, const int64_t* rows, int64_t len,
                       int64_t kvh_begin, int64_t kvh_end, int64_t G, int64_t BS, int64_t row,
                       const KvLayout& L, float scale, float* scores, bf16* out) {
  alignas(64) bf16 packed[D / TILE_K * TILE * TILE_K];
  const int64_t stride = (len + TILE - 1) / TILE * TILE;  // whole vectors: no scalar tails
  tiles.begin();
  for (int64_t kvh = kvh_begin; kvh < kvh_end; ++kvh) {
    pack_queries<D>(q + kvh * G * q_head_stride, q_head_stride, G, packed);
    tiles.template set_queries<D>(packed);
    const int64_t off = kvh * L.head;
    float max[TILE];
    score_by_tiles<Tiles, D>(tiles, kc, table, len, BS, BS * row, L.step, off, G, scale, scores,
                             stride, max);
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      float inv_sum[4];
      const int64_t gb = std::min<int64_t>(4, G - g0);
      for (int64_t g = 0; g < gb; ++g)
        inv_sum[g] = softmax_row_padded<bf16>(scores + (g0 + g) * stride, stride, max[g0 + g]);
      const float* s = scores + g0 * stride;
      bf16* og = out + (kvh * G + g0) * D;
      switch (gb) {
        case 1: weigh_values<bf16, D, 1>(s, inv_sum, vc, rows, len, off, og, stride); break;
        case 2: weigh_values<bf16, D, 2>(s, inv_sum, vc, rows, len, off, og, stride); break;
        case 3: weigh_values<bf16, D, 3>(s, inv_sum, vc, rows, len, off, og, stride); break;
        default: weigh_values<bf16, D, 4>(s, inv_sum, vc, rows, len, off, og, stride); break;
      }
    }
  }
  tiles.end();
}

// Which scorer a call uses: tiles where the setting, the build, the CPU and the shapes allow.
template <typename T, int D>
Scores scores_for(int64_t BS) {
  const auto mode = static_cast<Scores>(g_scores.load(std::memory_order_relaxed));
  if constexpr (!std::is_same_v<T, bf16> || D % TILE_K != 0) return Scores::fma;
  if (BS % TILE != 0 || mode == Scores::fma) return Scores::fma;
  if (mode == Scores::emulated) return Scores::emulated;
#if defined(PM_AMX)
  if (amx_permitted()) return Scores::amx;
#endif
  return Scores::fma;
}

// The KV heads [kvh_begin, kvh_end) of one sequence with token-minor keys.
template <typename T, int D>
void attend_item_tokens(const T* q, int64_t q_head_stride, const T* kc, const T* vc,
                        const int32_t* table, const int64_t* rows, int64_t len,
                        int64_t kvh_begin, int64_t kvh_end, int64_t G, int64_t BS,
                        const KvLayout& L, float scale, float* scores, T* out) {
  constexpr int V = D / W;
  std::vector<const T*> tv;
  token_vectors(kc, table, len, BS, L.kblock, tv);
  const int64_t nv = int64_t(tv.size());
  std::vector<float> qf(G * D);
  const fVec sv(scale);
  for (int64_t kvh = kvh_begin; kvh < kvh_end; ++kvh) {
    for (int64_t g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i)
        (loadf(q + (kvh * G + g) * q_head_stride + i * W) * sv).store(&qf[g * D + i * W]);
    const int64_t k_off = kvh * D * BS, v_off = kvh * L.head;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* qg = qf.data() + g0 * D;
      T* og = out + (kvh * G + g0) * D;
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: attend_heads_tokens<T, D, 1>(qg, tv.data(), nv, BS, k_off, vc, rows, len, v_off, scores, og); break;
        case 2: attend_heads_tokens<T, D, 2>(qg, tv.data(), nv, BS, k_off, vc, rows, len, v_off, scores, og); break;
        case 3: attend_heads_tokens<T, D, 3>(qg, tv.data(), nv, BS, k_off, vc, rows, len, v_off, scores, og); break;
        default: attend_heads_tokens<T, D, 4>(qg, tv.data(), nv, BS, k_off, vc, rows, len, v_off, scores, og); break;
      }
    }
  }
}

template <typename T, int D>
void attend_item(const T* q, int64_t q_head_stride, const T* kc, const T* vc,
                 const int32_t* table, int64_t len, int64_t kvh_begin, int64_t kvh_end,
                 int64_t G, int64_t BS, int64_t row, const KvLayout& L, float scale,
                 float* scores, T* out) {
  constexpr int V = D / W;
  static_assert(D % W == 0, "head_dim must be a multiple of the vector width");
  // Each token's row offset in the caches (KV head 0), worked out once (block by block, no
  // divisions): the values', and the keys' where they are not token-minor.
  std::vector<int64_t> rows(len);
  token_rows(table, len, BS, BS * row, L.step, rows.data());
  if (L.kblock > 0)
    return attend_item_tokens<T, D>(q, q_head_stride, kc, vc, table, rows.data(), len,
                                    kvh_begin, kvh_end, G, BS, L, scale, scores, out);
  if constexpr (std::is_same_v<T, bf16> && D % TILE_K == 0) {
    switch (scores_for<T, D>(BS)) {
#if defined(PM_AMX)
      case Scores::amx:
        return attend_item_tiles<AmxTiles, D>(AmxTiles{}, q, q_head_stride, kc, vc, table,
                                              rows.data(), len, kvh_begin, kvh_end, G, BS, row,
                                              L, scale, scores, out);
#endif
      case Scores::emulated:
        return attend_item_tiles<EmulatedTiles, D>(EmulatedTiles{}, q, q_head_stride, kc, vc,
                                                   table, rows.data(), len, kvh_begin, kvh_end,
                                                   G, BS, row, L, scale, scores, out);
      default:
        break;
    }
  }
  std::vector<fVec> qv(G * V);
  for (int64_t kvh = kvh_begin; kvh < kvh_end; ++kvh) {
    for (int64_t g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i)
        qv[g * V + i] = loadf(q + (kvh * G + g) * q_head_stride + i * W) * fVec(scale);
    const int64_t off = kvh * L.head;
    // Heads in groups of up to 4 (SmolLM2's 3, Llama's 4 and 8, Qwen's 7 = 4 + 3).
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const fVec* qg = qv.data() + g0 * V;
      T* og = out + (kvh * G + g0) * D;
      const int64_t* r = rows.data();
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: attend_heads<T, D, 1>(qg, kc, vc, r, len, off, scores, og); break;
        case 2: attend_heads<T, D, 2>(qg, kc, vc, r, len, off, scores, og); break;
        case 3: attend_heads<T, D, 3>(qg, kc, vc, r, len, off, scores, og); break;
        default: attend_heads<T, D, 4>(qg, kc, vc, r, len, off, scores, og); break;
      }
    }
  }
}

// A paged attention call's tensors as pointers and sizes: queries [N, H, D] (heads contiguous,
// rows possibly strided), caches [blocks, BS, KVH, D], block tables [S, MB] and lengths [S].
template <typename T>
struct Paged {
  const T* q;
  int64_t q_stride, q_head_stride, H, G;
  const T* kc;
  const T* vc;
  int64_t BS, KVH, row;
  const int32_t* tables;
  int64_t MB;
  const int32_t* lens;
  T* out;
  KvLayout layout;

  Paged(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
        const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& output)
      : q(query.data_ptr<T>()),
        q_stride(query.stride(0)),
        q_head_stride(query.stride(1)),
        H(query.size(1)),
        G(query.size(1) / k_cache.size(2)),
        kc(k_cache.data_ptr<T>()),
        vc(v_cache.data_ptr<T>()),
        BS(k_cache.size(1)),
        KVH(k_cache.size(2)),
        row(k_cache.size(2) * k_cache.size(3)),
        tables(block_tables.data_ptr<int32_t>()),
        MB(block_tables.size(1)),
        lens(seq_lens.data_ptr<int32_t>()),
        out(output.data_ptr<T>()),
        layout(check_kv_layout(k_cache, v_cache)) {}

  // Sequence s's one query (packed row r) against its whole context, KV heads [h0, h1).
  template <int D>
  void decode(int64_t s, int64_t r, int64_t h0, int64_t h1, float scale,
              std::vector<float>& scores) const {
    // Rows rounded up to whole tiles (the tile path pads its scores with -inf).
    scores.resize(G * ((std::max<int64_t>(lens[s], 1) + TILE - 1) / TILE * TILE));
    attend_item<T, D>(q + r * q_stride, q_head_stride, kc, vc, tables + s * MB, lens[s], h0, h1,
                      G, BS, row, layout, scale, scores.data(), out + r * H * D);
  }
};

// Where each of `threads` contiguous ranges of items starts, given each item's cost: range t is
// [cuts[t], cuts[t + 1]), cuts[threads] = the item count. Range t starts at the item boundary
// nearer to t / threads of the total cost; every range keeps at least one item.
std::vector<int64_t> balanced_cuts(const std::vector<int64_t>& costs, int64_t threads) {
  const int64_t n = int64_t(costs.size());
  threads = std::max<int64_t>(1, std::min(threads, n));
  std::vector<int64_t> sums(n + 1, 0), cuts(threads + 1, n);
  for (int64_t i = 0; i < n; ++i) sums[i + 1] = sums[i] + costs[i];
  cuts[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t target = sums[n] * t / threads;
    int64_t k = cuts[t - 1] + 1;
    while (k < n && sums[k] < target) ++k;
    if (k > cuts[t - 1] + 1 && target - sums[k - 1] < sums[k] - target) --k;
    cuts[t] = std::min(k, n - (threads - t));
  }
  return cuts;
}

// Runs fn(item, scratch) for items [0, n), split over the threads in contiguous ranges of about
// equal total `cost(item)`. at::parallel_for's split gives each thread the same number of
// items, which leaves one thread with the long sequences when lengths differ, as they do in a
// server's batch (older requests have longer contexts). Ranges stay contiguous, so a thread
// reads consecutive sequences, whose blocks a fresh pool lays one after another. (Handing items
// out one at a time, longest first, balanced as well in a scratch A/B and was no faster;
// docs/benchmarks.md, "Decode attention split by work".)
template <typename Scratch, typename Cost, typename Fn>
void for_each_balanced(int64_t n, Cost cost, Fn fn) {
  if (n <= 0) return;
  std::vector<int64_t> costs(n);
  for (int64_t i = 0; i < n; ++i) costs[i] = cost(i);
  const std::vector<int64_t> cuts = balanced_cuts(costs, at::get_num_threads());
  at::parallel_for(0, int64_t(cuts.size()) - 1, 1, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    for (int64_t i = cuts[t0]; i < cuts[t1]; ++i) fn(i, scratch);
  });
}

template <typename T, int D>
void decode_attention(const Paged<T>& p, int64_t B, float scale) {
  // Whole sequences per work item when there are enough to keep every thread busy (each
  // block is then streamed by one thread), else one (sequence, KV head) per item.
  const bool per_seq = B >= 4 * at::get_num_threads();
  const int64_t items = per_seq ? B : B * p.KVH;
  const int64_t heads = per_seq ? p.KVH : 1;
  for_each_balanced<std::vector<float>>(
      items,
      [&](int64_t item) { return (p.lens[per_seq ? item : item / p.KVH] + TILE) * heads; },
      [&](int64_t item, std::vector<float>& scores) {
        const int64_t b = per_seq ? item : item / p.KVH;
        const int64_t h0 = per_seq ? 0 : item % p.KVH, h1 = per_seq ? p.KVH : h0 + 1;
        p.template decode<D>(b, b, h0, h1, scale, scores);
      });
}

// Runs CALL with HD bound to the query's head_dim as a compile-time constant.
#define PM_HEAD_DIM(head_dim, CALL)                                         \
  switch (head_dim) {                                                       \
    case 16: { constexpr int HD = 16; CALL; return; }                       \
    case 32: { constexpr int HD = 32; CALL; return; }                       \
    case 64: { constexpr int HD = 64; CALL; return; }                       \
    case 96: { constexpr int HD = 96; CALL; return; }                       \
    case 128: { constexpr int HD = 128; CALL; return; }                     \
  }                                                                         \
  TORCH_CHECK(false, "head_dim must be 16, 32, 64, 96 or 128, got ", head_dim)

template <typename T>
void decode_attention_d(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                        const at::Tensor& bt, const at::Tensor& lens, at::Tensor& out,
                        float scale) {
  const Paged<T> p(q, kc, vc, bt, lens, out);
  PM_HEAD_DIM(q.size(2), (decode_attention<T, HD>(p, q.size(0), scale)));
}

// ---------------------------------------------------------------- paged prefill attention
// A step with prefills: sequences with several new tokens (a prompt, or a chunk of one after
// its cached prefix) and decodes, in one call. New token i of a sequence with `ctx` tokens and
// `q_len` new ones sits at position ctx - q_len + i and attends to keys 0..position (causal).
//
// Decodes go through the decode path above. A prefill reads its keys many times (once per
// query tile), so it first stages every (sequence, KV head)'s keys and values as float32 in
// scratch: keys transposed in tiles of W tokens (kt[tile][d][j] = key tile*W + j's element d),
// values as rows. Then a work item is a tile of up to QT query tokens of one KV head: its
// QT * G query vectors score W keys a vector at a time (one FMA per query element against a
// transposed key column: no lane reductions), take a causal softmax row by row, and weigh the
// value rows (one FMA per value vector and query vector). Items run longest first, handed out
// one at a time, so threads finish together although later tiles attend to more keys.

constexpr int64_t QT = 16;            // query tokens per work item
constexpr int SCORE_ROWS = 8;         // query vectors scored together
constexpr int PV_ROWS = W >= 16 ? 6 : 2;  // query vectors weighed together (registers)

// Keys of one (sequence, KV head) transposed in tiles of W tokens, zero past the end, and its
// values as float rows.
template <typename T, int D>
void stage_kv(const T* kc, const T* vc, const int64_t* rows, int64_t len, int64_t off,
              float* kt, float* vf) {
  constexpr int V = D / W;
  float buf[D];
  for (int64_t tile = 0; tile * W < len; ++tile) {
    float* out = kt + tile * D * W;
    for (int64_t j = 0; j < W; ++j) {
      const int64_t t = tile * W + j;
      if (t >= len) {
        for (int d = 0; d < D; ++d) out[d * W + j] = 0.f;
        continue;
      }
      for (int i = 0; i < V; ++i) loadf(kc + rows[t] + off + i * W).store(buf + i * W);
      for (int d = 0; d < D; ++d) out[d * W + j] = buf[d];
      for (int i = 0; i < V; ++i) loadf(vc + rows[t] + off + i * W).store(vf + t * D + i * W);
    }
  }
}

// stage_kv from token-minor keys (kblock elements a block, KV head h, whose value rows start
// v_off past each token's row): each tile of W tokens lies inside one block (BS is a multiple
// of W), so its transposed keys are D vector copies.
template <typename T, int D>
void stage_kv_tokens(const T* kc, const T* vc, const int32_t* table, int64_t BS, int64_t kblock,
                     const int64_t* rows, int64_t len, int64_t h, int64_t v_off, float* kt,
                     float* vf) {
  constexpr int V = D / W;
  for (int64_t tile = 0; tile * W < len; ++tile) {
    const int64_t t0 = tile * W, n = std::min<int64_t>(W, len - t0);
    const T* k = kc + int64_t(table[t0 / BS]) * kblock + h * D * BS + t0 % BS;
    float* out = kt + tile * D * W;
    for (int d = 0; d < D; ++d) {
      loadf(k + d * BS).store(out + d * W);
      std::fill(out + d * W + n, out + d * W + W, 0.f);  // past the end: zero, as stage_kv
    }
    for (int64_t t = t0; t < t0 + n; ++t)
      for (int i = 0; i < V; ++i)
        loadf(vc + rows[t] + v_off + i * W).store(vf + t * D + i * W);
  }
}

// scores[n][t] = q[n] . k[t] for NQ query vectors against `tiles` tiles of transposed keys.
template <int D, int NQ>
inline void score_group(const float* q, const float* kt, int64_t tiles, float* scores,
                        int64_t stride) {
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const float* k = kt + tile * D * W;
    fVec acc[NQ];
    for (int n = 0; n < NQ; ++n) acc[n] = fVec(0.f);
    for (int d = 0; d < D; ++d) {
      const fVec kd = fVec::loadu(k + d * W);
      for (int n = 0; n < NQ; ++n) acc[n] = at::vec::fmadd(fVec(q[n * D + d]), kd, acc[n]);
    }
    for (int n = 0; n < NQ; ++n) acc[n].store(scores + n * stride + tile * W);
  }
}

// outs[n] = inv[n] * sum_t p[n][t] * v[t] for NP query vectors, CH vectors of head_dim a pass.
template <typename T, int D, int NP>
inline void weigh_group(const float* p, int64_t stride, const float* vf, int64_t len,
                        const float* inv, T* const* outs) {
  constexpr int V = D / W;
  constexpr int CH = V % 4 == 0 ? 4 : (V % 3 == 0 ? 3 : (V % 2 == 0 ? 2 : 1));
  for (int c = 0; c < V; c += CH) {
    fVec acc[NP][CH];
    for (int n = 0; n < NP; ++n)
      for (int i = 0; i < CH; ++i) acc[n][i] = fVec(0.f);
    for (int64_t t = 0; t < len; ++t) {
      const float* v = vf + t * D + c * W;
      fVec vv[CH];
      for (int i = 0; i < CH; ++i) vv[i] = fVec::loadu(v + i * W);
      for (int n = 0; n < NP; ++n) {
        const fVec pn(p[n * stride + t]);
        for (int i = 0; i < CH; ++i) acc[n][i] = at::vec::fmadd(pn, vv[i], acc[n][i]);
      }
    }
    for (int n = 0; n < NP; ++n) {
      const fVec norm(inv[n]);
      for (int i = 0; i < CH; ++i) storef(outs[n] + (c + i) * W, acc[n][i] * norm);
    }
  }
}

template <int D, int N = SCORE_ROWS>
inline void score_rest(int64_t count, const float* q, const float* kt, int64_t tiles,
                       float* scores, int64_t stride) {
  if constexpr (N > 0) {
    if (count == N) return score_group<D, N>(q, kt, tiles, scores, stride);
    score_rest<D, N - 1>(count, q, kt, tiles, scores, stride);
  }
}

template <typename T, int D, int N = PV_ROWS>
inline void weigh_rest(int64_t count, const float* p, int64_t stride, const float* vf,
                       int64_t len, const float* inv, T* const* outs) {
  if constexpr (N > 0) {
    if (count == N) return weigh_group<T, D, N>(p, stride, vf, len, inv, outs);
    weigh_rest<T, D, N - 1>(count, p, stride, vf, len, inv, outs);
  }
}

// Query tokens [r0, r1) of one sequence (the first at position first_pos) and one KV head.
template <typename T, int D>
void prefill_tile(const T* q, int64_t q_stride, int64_t q_head_stride, int64_t kvh, int64_t G,
                  int64_t r0, int64_t r1, int64_t first_pos, const float* kt, const float* vf,
                  float scale, T* out, int64_t out_stride, std::vector<float>& qbuf,
                  std::vector<float>& scores, std::vector<float>& inv, std::vector<T*>& outs) {
  constexpr int V = D / W;
  const int64_t nq = (r1 - r0) * G;
  const int64_t len = first_pos + r1;  // keys the tile's last token attends to
  const int64_t tiles = (len + W - 1) / W, stride = tiles * W;
  qbuf.resize(nq * D);
  scores.resize(nq * stride);
  inv.resize(nq);
  outs.resize(nq);
  const fVec sv(scale);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = (r - r0) * G + g, h = kvh * G + g;
      for (int i = 0; i < V; ++i)
        (loadf(q + r * q_stride + h * q_head_stride + i * W) * sv).store(&qbuf[n * D + i * W]);
      outs[n] = out + r * out_stride + h * D;
    }
  for (int64_t n = 0; n < nq; n += SCORE_ROWS)
    score_rest<D>(std::min<int64_t>(SCORE_ROWS, nq - n), &qbuf[n * D], kt, tiles,
                  &scores[n * stride], stride);
  for (int64_t n = 0; n < nq; ++n) {
    const int64_t attended = first_pos + r0 + n / G + 1;
    float* s = &scores[n * stride];
    const int64_t padded = round_up(attended, W);  // <= stride
    inv[n] = softmax_padded<T>(s, attended, padded);  // causal: later keys weigh nothing
    if (padded < len) std::fill(s + padded, s + len, 0.f);
  }
  for (int64_t n = 0; n < nq; n += PV_ROWS)
    weigh_rest<T, D>(std::min<int64_t>(PV_ROWS, nq - n), &scores[n * stride], stride, vf, len,
                     &inv[n], &outs[n]);
}

template <typename T, int D>
void prefill_attention(const Paged<T>& p, const int32_t* qs, int64_t S, float scale) {
  const int64_t KVH = p.KVH, G = p.G, out_stride = p.H * D;
  const int32_t* lp = p.lens;

  // Scratch for the prefills' staged keys and values: where each (sequence, KV head) starts.
  std::vector<int64_t> kt_at(S * KVH, -1), vf_at(S * KVH, -1);
  std::vector<int64_t> staged;  // sequences with prefills
  int64_t kt_size = 0, vf_size = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (qs[s + 1] - qs[s] <= 1) continue;
    staged.push_back(s);
    const int64_t padded = (lp[s] + W - 1) / W * W;
    for (int64_t h = 0; h < KVH; ++h) {
      kt_at[s * KVH + h] = kt_size;
      vf_at[s * KVH + h] = vf_size;
      kt_size += padded * D;
      vf_size += lp[s] * D;
    }
  }
  // Not zero-filled: stage_kv writes every element (zeros past each sequence's end itself).
  std::unique_ptr<float[]> kt(new float[kt_size]), vf(new float[vf_size]);
  at::parallel_for(0, int64_t(staged.size()) * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = staged[item / KVH], h = item % KVH;
      rows.resize(lp[s]);
      token_rows(p.tables + s * p.MB, lp[s], p.BS, p.BS * p.row, p.layout.step, rows.data());
      float* kts = kt.get() + kt_at[s * KVH + h];
      float* vfs = vf.get() + vf_at[s * KVH + h];
      if (p.layout.kblock > 0)
        stage_kv_tokens<T, D>(p.kc, p.vc, p.tables + s * p.MB, p.BS, p.layout.kblock, rows.data(),
                              lp[s], h, h * p.layout.head, kts, vfs);
      else
        stage_kv<T, D>(p.kc, p.vc, rows.data(), lp[s], h * p.layout.head, kts, vfs);
    }
  });

  // Work items, longest first: a decode (every KV head) or a prefill tile of one KV head.
  struct Item {
    int64_t cost, s, h, r0, r1;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    if (q_len == 1) {
      items.push_back({lp[s] * p.H, s, -1, 0, 1});
      continue;
    }
    for (int64_t r0 = 0; r0 < q_len; r0 += QT) {
      const int64_t r1 = std::min(q_len, r0 + QT);
      for (int64_t h = 0; h < KVH; ++h)
        items.push_back({(lp[s] - q_len + r1) * (r1 - r0) * G, s, h, r0, r1});
    }
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), int64_t(items.size()));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qbuf, scores, inv;
    std::vector<T*> outs;
    for (int64_t i = next++; i < int64_t(items.size()); i = next++) {
      const Item& it = items[i];
      const int64_t s = it.s, q_len = qs[s + 1] - qs[s], first = qs[s];
      if (it.h < 0) {
        p.template decode<D>(s, first, 0, KVH, scale, scores);
        continue;
      }
      prefill_tile<T, D>(p.q + first * p.q_stride, p.q_stride, p.q_head_stride, it.h, G, it.r0,
                         it.r1, lp[s] - q_len, kt.get() + kt_at[s * KVH + it.h],
                         vf.get() + vf_at[s * KVH + it.h], scale, p.out + first * out_stride,
                         out_stride, qbuf, scores, inv, outs);
    }
  });
}

template <typename T>
void prefill_attention_d(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                         const at::Tensor& bt, const at::Tensor& qs, const at::Tensor& lens,
                         at::Tensor& out, float scale) {
  const Paged<T> p(q, kc, vc, bt, lens, out);
  const int32_t* starts = qs.data_ptr<int32_t>();
  PM_HEAD_DIM(q.size(2), (prefill_attention<T, HD>(p, starts, lens.size(0), scale)));
}

// The sum of what read_kv reads of one sequence's `len` tokens, for each way a cache is laid
// out. Token-minor keys: a block's run at a time, whole (the cache lines the kernel reads).
template <typename T>
fVec read_token_minor(const T* c, const int32_t* table, int64_t len, int64_t BS, int64_t block) {
  fVec acc(0.f);
  const int64_t blocks = (len + BS - 1) / BS;
  for (int64_t j = 0; j < blocks; ++j) {
    if (j + PREFETCH_BLOCKS < blocks)
      prefetch_span(c + table[j + PREFETCH_BLOCKS] * block, block * sizeof(T));
    const T* r = c + table[j] * block;
    for (int64_t i = 0; i + W <= block; i += W) acc = acc + loadf(r + i);
  }
  return acc;
}

// Head-major rows: each head's rows of a block's tokens, one run.
template <typename T>
fVec read_head_runs(const T* c, const int32_t* table, int64_t len, int64_t BS, int64_t block,
                    int64_t KVH, int64_t D) {
  fVec acc(0.f);
  const int64_t blocks = (len + BS - 1) / BS;
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t h = 0; h < KVH; ++h) {
      if (j + PREFETCH_BLOCKS < blocks) {
        const int64_t n = std::min(BS, len - (j + PREFETCH_BLOCKS) * BS);
        prefetch_span(c + table[j + PREFETCH_BLOCKS] * block + h * BS * D, n * D * sizeof(T));
      }
      const T* r = c + table[j] * block + h * BS * D;
      const int64_t n = std::min(BS, len - j * BS) * D;
      for (int64_t i = 0; i + W <= n; i += W) acc = acc + loadf(r + i);
    }
  return acc;
}

// Rows: each token's row of every head.
template <typename T>
fVec read_rows(const T* c, const int64_t* rows, int64_t len, int64_t row) {
  fVec acc(0.f);
  for (int64_t t = 0; t < len; ++t) {
    if (t + PREFETCH_TOKENS < len) prefetch_span(c + rows[t + PREFETCH_TOKENS], row * sizeof(T));
    const T* r = c + rows[t];
    for (int64_t i = 0; i + W <= row; i += W) acc = acc + loadf(r + i);
  }
  return acc;
}

// One read of every cached key and value the step attends to, the way the kernel reads them
// (block by block through the tables): the attention's memory floor, for the benchmarks.
template <typename T>
double read_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
               const at::Tensor& lens) {
  const int64_t B = tables.size(0), MB = tables.size(1), BS = k_cache.size(1);
  const int64_t KVH = k_cache.size(2), D = k_cache.size(3), row = KVH * D;
  const KvLayout L = check_kv_layout(k_cache, v_cache);
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  std::vector<double> partial(B, 0.0);
  // Shared out as the decode kernel shares its sequences, so that the floor is not a worse
  // split than the kernel's own when lengths differ.
  for_each_balanced<std::vector<int64_t>>(
      B, [&](int64_t b) { return int64_t(lp[b]); },
      [&](int64_t b, std::vector<int64_t>& rows) {
        const int32_t* table = tp + b * MB;
        const int64_t len = lp[b], block = BS * row;
        fVec acc(0.f);
        if (L.kblock > 0) acc = acc + read_token_minor(kc, table, len, BS, block);
        for (const T* cache : {kc, vc}) {
          if (cache == kc && L.kblock > 0) continue;
          if (L.step == D) {
            acc = acc + read_head_runs(cache, table, len, BS, block, KVH, D);
          } else {
            rows.resize(len);
            token_rows(table, len, BS, block, row, rows.data());
            acc = acc + read_rows(cache, rows.data(), len, row);
          }
        }
        partial[b] = hsum(acc);
      });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

// ---------------------------------------------------------------- elementwise kernels
namespace plain_cvt {
#include "elementwise.h"
}  // namespace plain_cvt

#if defined(CPU_CAPABILITY_AVX512)
#define PM_NATIVE_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512bf16")
namespace native_cvt {
// float32 pairs to bfloat16 in one vcvtne2ps2bf16, where ATen's emulation takes ~10 integer
// instructions per vector. The instruction treats denormal inputs as zero and writes its own
// NaNs; a pair holding either (rare in a model's activations) takes ATen's conversion, so
// the bits are ATen's everywhere.
inline __m512i to_bf16(const fVec& a, const fVec& b) {
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // quiet NaN, denormal, signalling NaN
  const __mmask16 odd =
      _mm512_fpclass_ps_mask(a, kNanOrDenormal) | _mm512_fpclass_ps_mask(b, kNanOrDenormal);
  if (__builtin_expect(odd != 0, 0)) return at::vec::convert_from_float<at::BFloat16>(a, b);
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
}

template <typename T>
inline void store2(T* p, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    _mm512_storeu_si512(p, to_bf16(a, b));
  } else {
    ::store2<T>(p, a, b);
  }
}

template <typename T>
inline void round2(fVec& a, fVec& b) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    std::tie(a, b) = at::vec::convert_to_float<at::BFloat16>(to_bf16(a, b));
  } else {
    ::round2<T>(a, b);
  }
}

#include "elementwise.h"
}  // namespace native_cvt
#pragma GCC pop_options
#endif

// false: plain_cvt everywhere (set_bf16_convert("emulated"), for tests on any CPU).
std::atomic<bool> g_native_bf16{true};

// The call from native_cvt for bfloat16 where that runs here (native_bf16()), else plain_cvt's.
#if defined(PM_NATIVE_BF16)
#define PM_ELEMENTWISE(...)                                      \
  if (std::is_same_v<scalar_t, at::BFloat16> && native_bf16()) { \
    native_cvt::__VA_ARGS__;                                     \
  } else {                                                       \
    plain_cvt::__VA_ARGS__;                                      \
  }
#else
#define PM_ELEMENTWISE(...) plain_cvt::__VA_ARGS__
#endif

// ---------------------------------------------------------------- greedy sampling
// Index of each row's largest value, the first one on ties (torch.argmax's answer; a row with
// a NaN answers its first NaN, as torch's does). A vector pass finds the maximum, a second
// finds where it is. torch's own argmax on [64, 49152] logits took 3-8 ms on 2 cores, a
// twentieth of a decode step.
template <typename T>
void argmax_rows_impl(const T* x, int64_t rows, int64_t n, int64_t stride, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * stride;
      fVec mx(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + W <= n; i += W) mx = at::vec::maximum(mx, loadf(row + i));
      float m = at::vec::vec_reduce_all<float>(
          [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, mx);
      for (; i < n; ++i) {
        const float v = to_float(row[i]);
        m = std::isnan(v) || v > m ? v : m;
      }
      int64_t at = 0;
      if (std::isnan(m)) {
        while (at < n && !std::isnan(to_float(row[at]))) ++at;
      } else {
        const fVec mv(m);  // skip whole vectors without the maximum, then find it in one
        while (at + W <= n && (loadf(row + at) == mv).zero_mask() == (1 << W) - 1) at += W;
        while (at < n && to_float(row[at]) != m) ++at;
      }
      out[r] = at;
    }
  });
}

#define PM_DISPATCH(dtype, NAME, ...)                                       \
  switch (dtype) {                                                          \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }        \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__; break; } \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__; break; }      \
    default: TORCH_CHECK(false, NAME, ": unsupported dtype ", dtype);       \
  }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

namespace pm {
bool pairs_hardware();
}  // namespace pm

// Whether the bfloat16 elementwise kernels convert with vcvtne2ps2bf16 here: an AVX-512 build
// on a CPU with AVX-512 BF16 (what pairs_hardware checks), unless set to "emulated".
bool native_bf16() { return g_native_bf16.load(std::memory_order_relaxed) && pm::pairs_hardware(); }

// ---------------------------------------------------------------- entry points
at::Tensor paged_decode(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor seq_lens, double scale,
                        c10::optional<at::Tensor> out_buffer) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [B, H, D] with contiguous heads");
  check_kv_layout(k_cache, v_cache);  // refuses a layout the kernels cannot read
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(1) / k_cache.size(2) <= 16,
              "query heads must be a multiple (<= 16) of the KV heads");
  auto out = pm::output_for(out_buffer, query.sizes(), query, "paged_decode");
  const float s = static_cast<float>(scale);
  PM_DISPATCH(query.scalar_type(), "paged_decode",
              decode_attention_d<scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, s));
  return out;
}

at::Tensor paged_prefill(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor block_tables, at::Tensor query_start_loc,
                         at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [N, H, D] with contiguous heads");
  check_kv_layout(k_cache, v_cache);  // refuses a layout the kernels cannot read
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "block tables, query starts and lengths must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block tables, query starts and lengths must be int32");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1, "query_start_loc must be [S + 1]");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(1) / k_cache.size(2) <= 16,
              "query heads must be a multiple (<= 16) of the KV heads");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  const float s = static_cast<float>(scale);
  PM_DISPATCH(query.scalar_type(), "paged_prefill",
              prefill_attention_d<scalar_t>(query, k_cache, v_cache, block_tables,
                                            query_start_loc, seq_lens, out, s));
  return out;
}

at::Tensor exp_f32_tensor(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
  auto y = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t n = x.numel();
  int64_t i = 0;
  for (; i + W <= n; i += W) exp_f32(fVec::loadu(in + i)).store(out + i);
  if (i < n) exp_f32(fVec::loadu(in + i, n - i)).store(out + i, n - i);
  return y;
}

double read_kv_once(at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                    at::Tensor seq_lens) {
  double total = 0;
  PM_DISPATCH(k_cache.scalar_type(), "read_kv_once",
              total = read_kv<scalar_t>(k_cache, v_cache, block_tables, seq_lens));
  return total;
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  PM_DISPATCH(x.scalar_type(), "rms_norm",
              PM_ELEMENTWISE(rms_norm_rows<scalar_t>(
                  x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(),
                  out.data_ptr<scalar_t>(), rows, n, x.stride(0), static_cast<float>(eps))));
  return out;
}

at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps,
                        c10::optional<at::Tensor> out_buffer) {
  check_rows(x, "x");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(),
              "residual must be contiguous and shaped like x");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = pm::output_for(out_buffer, {rows, n}, x, "add_rms_norm");
  PM_DISPATCH(x.scalar_type(), "add_rms_norm",
              PM_ELEMENTWISE(rms_norm_rows<scalar_t>(
                  x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                  weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n, x.stride(0),
                  static_cast<float>(eps))));
  return out;
}

void rope_write_kv(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                   int64_t num_heads, int64_t num_kv_heads, at::Tensor k_cache,
                   at::Tensor v_cache, at::Tensor slot_mapping) {
  check_rows(qkv, "qkv");
  const int64_t D = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) >= (num_heads + 2 * num_kv_heads) * D, "qkv too narrow");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong);
  const KvLayout L = check_kv_layout(k_cache, v_cache);
  PM_DISPATCH(qkv.scalar_type(), "rope_write_kv",
              PM_ELEMENTWISE(rope_write<scalar_t>(
                  qkv.data_ptr<scalar_t>(), qkv.size(0), qkv.stride(0),
                  positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  num_heads, num_kv_heads, D, k_cache.data_ptr<scalar_t>(),
                  v_cache.data_ptr<scalar_t>(), slot_mapping.data_ptr<int64_t>(),
                  k_cache.size(1), L.kblock, L.step, L.head)));
}

at::Tensor silu_and_mul(at::Tensor gate_up, c10::optional<at::Tensor> out_buffer) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [T, 2I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = pm::output_for(out_buffer, {rows, inter}, gate_up, "silu_and_mul");
  PM_DISPATCH(gate_up.scalar_type(), "silu_and_mul",
              PM_ELEMENTWISE(silu_mul_rows<scalar_t>(
                  gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter)));
  return out;
}

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "x must be 2-D with contiguous, non-empty rows");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  PM_DISPATCH(x.scalar_type(), "argmax_rows",
              argmax_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                         x.stride(0), out.data_ptr<int64_t>()));
  return out;
}

// How paged decode attention scores keys from now on: "auto" (tiles on an AMX build and CPU,
// for bfloat16 caches; else FMAs), "fma", "amx" (an error where this build or CPU has no
// tiles) or "emulated" (the tile path's arithmetic in plain C++, for tests on any CPU).
// Returns the scorer "auto" resolves to here.
std::string isa();

std::string set_decode_scores(const std::string& mode) {
  Scores chosen;
  if (mode == "auto") chosen = Scores::automatic;
  else if (mode == "fma") chosen = Scores::fma;
  else if (mode == "emulated") chosen = Scores::emulated;
  else if (mode == "amx") chosen = Scores::automatic;
  else TORCH_CHECK(false, "decode scores must be auto, fma, amx or emulated, got ", mode);
  bool tiles = false;
#if defined(PM_AMX)
  tiles = amx_permitted();
#endif
  TORCH_CHECK(mode != "amx" || tiles, "this build or CPU has no AMX tiles (build: ", isa(), ")");
  g_scores.store(static_cast<int>(chosen));
  return tiles ? "amx" : "fma";
}

// How the bfloat16 elementwise kernels convert from now on: "auto" (vcvtne2ps2bf16 where the
// build and the CPU have it) or "emulated" (ATen's integer conversion, on any CPU). Returns the
// conversion "auto" resolves to here: "native" or "emulated".
std::string set_bf16_convert(const std::string& mode) {
  TORCH_CHECK(mode == "auto" || mode == "emulated",
              "bfloat16 conversion must be auto or emulated, got ", mode);
  g_native_bf16.store(mode == "auto");
  return pm::pairs_hardware() ? "native" : "emulated";
}

// Floats in this build's vectors (8 under AVX2, 16 under AVX-512).
int64_t vector_width() { return W; }

// Which vector width this build uses, e.g. "avx2 (8 floats)".
std::string isa() {
#if defined(PM_AMX)
  std::string name = "amx";
#elif defined(CPU_CAPABILITY_AVX512)
  std::string name = "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  std::string name = "avx2";
#else
  std::string name = "generic";
#endif
  return name + " (" + std::to_string(W) + " floats)";
}

// The linear layers: bfloat16 on AVX-512 BF16 (kernels/csrc/pair_gemm.cpp) and float32.
namespace pm {
at::Tensor pack_pairs(at::Tensor weight);
at::Tensor pairs_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                        bool emulate, c10::optional<at::Tensor> out);
// The float32 linear layers (kernels/csrc/panel_gemm.cpp).
int64_t panel_width();
// Whether panels_linear asks for each thread's next panels ahead (on by default); returns the
// setting before. Off only to measure what it saves (prefixmesh bench gemm).
bool set_panel_ahead(bool on);
at::Tensor pack_panels(at::Tensor weight);
at::Tensor panels_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                         c10::optional<at::Tensor> out);
}  // namespace pm

// The attention kernels and the GEMMs run without the GIL, as torch's own ops do: a step's
// prefill GEMM takes tens of ms, and a replica's event loop (gRPC, a peer's block fetch, the
// Redis lease) must not wait for it. They touch no Python object. The elementwise kernels
// take microseconds and keep it (releasing it costs about as much).
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // `out`: a buffer to write the result into (kernels/csrc/output.h), else a new tensor.
  m.def("paged_decode", &paged_decode, "paged decode attention", py::arg("query"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("out") = py::none(), NoGil());
  m.def("paged_prefill", &paged_prefill, "paged attention of a step with prefills (causal)",
        NoGil());
  m.def("exp_f32", &exp_f32_tensor, "the kernels' float32 exp over a contiguous tensor (tests)");
  m.def("read_kv_once", &read_kv_once, "one read of the keys and values (benchmark floor)");
  m.def("balanced_cuts", &balanced_cuts,
        "where each thread's contiguous range of decode items starts, split by cost");
  m.def("rms_norm", &rms_norm, "RMSNorm");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of the residual",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::arg("out") = py::none());
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q and k in place, then write k and v");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", py::arg("gate_up"),
        py::arg("out") = py::none());
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (first on ties)");
  m.def("isa", &isa, "the ISA this build targets");
  m.def("vector_width", &vector_width, "floats in this build's vectors");
  m.def("set_decode_scores", &set_decode_scores,
        "how decode attention scores keys: auto, fma, amx or emulated");
  m.def("set_bf16_convert", &set_bf16_convert,
        "how the bfloat16 elementwise kernels convert: auto or emulated");
  m.def("pairs_hardware", &pm::pairs_hardware,
        "whether pairs_linear runs on vdpbf16ps here (this build and CPU)");
  m.def("pack_pairs", &pm::pack_pairs, "a bfloat16 [out, in] weight packed for pairs_linear");
  m.def("pairs_linear", &pm::pairs_linear, "x @ weight.T (+ bias) on a pair-packed weight",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(),
        py::arg("emulate") = false, py::arg("out") = py::none(), NoGil());
  m.def("panel_width", &pm::panel_width, "float32 output features per panel in this build");
  m.def("set_panel_ahead", &pm::set_panel_ahead,
        "whether panels_linear asks for the next panels ahead (returns the old setting)");
  m.def("pack_panels", &pm::pack_panels, "a float32 [out, in] weight packed for panels_linear");
  m.def("panels_linear", &pm::panels_linear, "x @ weight.T (+ bias) on a panel-packed weight",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out") = py::none(),
        NoGil());
}
