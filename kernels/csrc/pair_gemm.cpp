// bfloat16 GEMM on AVX-512 BF16's pair dot products (vdpbf16ps), for the linear layers.
//
// out[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n]), bfloat16 in and out, float32 sums.
//
// Why our own: oneDNN's bfloat16 kernels on CPUs with AVX-512 BF16 but no AMX reach 15-25 GB/s
// of weights at decode-sized batches (1-16 rows), where the step is a stream of every weight
// once, and 640-820 GFLOP/s at 64 rows (docs/benchmarks.md). The loop below streams the weights
// once per call at any row count and runs at ~900 GFLOP/s (the unit's peak) from 64 rows up.
//
// Layout: the weight [N, K] is packed once into [N / 16][K / 2][16][2]: for each block of 16
// output features, for each pair of inputs (2p, 2p + 1), the 16 features' pairs side by side,
// so one 64-byte load is the operand of one vdpbf16ps. A work item is NT blocks (NT * 16
// features); for MR rows at a time it keeps MR x NT float32 accumulators in registers, and for
// each input pair broadcasts a row's pair and multiplies it into the NT weight vectors. Items
// are spread over the threads; each streams its own slice of the weight once, from memory, and
// then from cache for the next MR rows.
//
// Every row is summed in the same order whatever the number of rows or threads, so a row's
// result never depends on what it is batched with (batch invariance for free, see
// kernels/cpu_linear.py).
//
// The vdpbf16ps path exists in the AVX-512 builds, and runs where the CPU has AVX-512 BF16. The
// emulated path does the same sums in plain C++ (each pair's two exact products added to the
// float32 sum one after the other, as Intel documents the instruction) in every build, so the
// packing, the blocking and the tails are tested on any CPU. The two paths need not agree bit
// for bit (the instruction flushes denormals; AMD and Intel may add the pair differently).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>
#include <utility>

#include "output.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <immintrin.h>
#define PM_PAIRS_HW 1
#endif

namespace pm {
namespace {

constexpr int64_t BLOCK = 16;  // output features per packed block (one vector of float32)

using bf16 = at::BFloat16;

// Blocks per work item: 3 where the block count allows (8 rows x 3 blocks = 24 accumulators, 3
// weight vectors and a broadcast: 28 of the 32 registers), else 2 or 1.
inline int blocks_per_item(int64_t blocks) { return blocks % 3 == 0 ? 3 : (blocks % 2 == 0 ? 2 : 1); }

// ---------------------------------------------------------------- emulated (any build)
// GCC 12's loop vectorizer at -O3 miscompiles this loop nest (a product counted twice when the
// input has three or more pairs; reproduced outside torch), so it stays scalar: it exists for
// tests, not for speed.
#if defined(__GNUC__) && !defined(__clang__)
#define PM_NO_VECTORIZE __attribute__((optimize("no-tree-vectorize")))
#else
#define PM_NO_VECTORIZE
#endif

PM_NO_VECTORIZE void emulated_item(const bf16* x, int64_t x_stride, int64_t M, int64_t K, const bf16* wp,
                   const bf16* bias, bf16* out, int64_t N, int64_t block) {
  const int64_t KP = K / 2;
  const bf16* w = wp + block * KP * 2 * BLOCK;
  for (int64_t m = 0; m < M; ++m) {
    const bf16* a = x + m * x_stride;
    for (int64_t j = 0; j < BLOCK; ++j) {
      float acc = 0.f;
      for (int64_t p = 0; p < KP; ++p) {
        const bf16* pair = w + p * 2 * BLOCK + 2 * j;
        acc += static_cast<float>(a[2 * p + 1]) * static_cast<float>(pair[1]);
        acc += static_cast<float>(a[2 * p]) * static_cast<float>(pair[0]);
      }
      const int64_t n = block * BLOCK + j;
      out[m * N + n] = static_cast<bf16>(bias ? acc + static_cast<float>(bias[n]) : acc);
    }
  }
}

// ---------------------------------------------------------------- vdpbf16ps (AVX-512 builds)
#if defined(PM_PAIRS_HW)
#define PM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return (eax >> 5) & 1;  // CPUID.(EAX=7, ECX=1):EAX[5] = AVX512_BF16
}

template <int MR, int NT>
PM_BF16_TARGET inline void micro(const bf16* x, int64_t x_stride, int64_t KP, const bf16* w,
                                 const bf16* bias, bf16* out, int64_t N, int64_t n0) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const bf16* wt[NT];
  for (int t = 0; t < NT; ++t) wt[t] = w + t * KP * 2 * BLOCK;
  for (int64_t p = 0; p < KP; ++p) {
    __m512bh wv[NT];
    for (int t = 0; t < NT; ++t) {
      wv[t] = (__m512bh)_mm512_loadu_si512(wt[t] + p * 2 * BLOCK);
      _mm_prefetch(reinterpret_cast<const char*>(wt[t] + (p + 16) * 2 * BLOCK), _MM_HINT_T0);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], a, wv[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const __m512 b = bias ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(bias + n0 + t * BLOCK)))
                          : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m512 v = bias ? _mm512_add_ps(acc[m][t], b) : acc[m][t];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + n0 + t * BLOCK),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// The last `rows` (< MR) rows of an item, with a kernel of exactly that many rows.
template <int NT, int R, int MR>
PM_BF16_TARGET void tail(int64_t rows, const bf16* x, int64_t x_stride, int64_t KP,
                         const bf16* w, const bf16* bias, bf16* out, int64_t N, int64_t n0) {
  if constexpr (R < MR) {
    if (rows == R) return micro<R, NT>(x, x_stride, KP, w, bias, out, N, n0);
    return tail<NT, R + 1, MR>(rows, x, x_stride, KP, w, bias, out, N, n0);
  }
}

template <int NT, int MR>
PM_BF16_TARGET void hw_item(const bf16* x, int64_t x_stride, int64_t M, int64_t K,
                            const bf16* wp, const bf16* bias, bf16* out, int64_t N,
                            int64_t first_block) {
  const int64_t KP = K / 2;
  const bf16* w = wp + first_block * KP * 2 * BLOCK;
  const int64_t n0 = first_block * BLOCK;
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    micro<MR, NT>(x + m * x_stride, x_stride, KP, w, bias, out + m * N, N, n0);
  if (m < M) tail<NT, 1, MR>(M - m, x + m * x_stride, x_stride, KP, w, bias, out + m * N, N, n0);
}
#endif

}  // namespace

// Whether pairs_linear runs on vdpbf16ps here (this build and this CPU), not emulated.
bool pairs_hardware() {
#if defined(PM_PAIRS_HW)
  static const bool has = cpu_has_bf16();
  return has;
#else
  return false;
#endif
}

at::Tensor pack_pairs(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be a 2-D bfloat16 [out, in] tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % BLOCK == 0 && K % 2 == 0,
              "pair packing needs out features a multiple of 16 and in features even (got [", N,
              ", ", K, "])");
  const auto w = weight.contiguous();
  auto packed = at::empty({N / BLOCK, K / 2, 2 * BLOCK}, w.options());
  const bf16* src = w.data_ptr<bf16>();
  bf16* dst = packed.data_ptr<bf16>();
  at::parallel_for(0, N / BLOCK, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t p = 0; p < K / 2; ++p)
        for (int64_t j = 0; j < BLOCK; ++j)
          for (int64_t i = 0; i < 2; ++i)
            dst[(b * (K / 2) + p) * 2 * BLOCK + 2 * j + i] = src[(b * BLOCK + j) * K + 2 * p + i];
  });
  return packed;
}

at::Tensor pairs_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                        bool emulate, c10::optional<at::Tensor> out_buffer) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be 2-D bfloat16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * BLOCK && packed.is_contiguous(),
              "packed must come from pack_pairs");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * BLOCK;
  TORCH_CHECK(packed.size(1) * 2 == K, "x has ", K, " features, the weight ", packed.size(1) * 2);
  const bf16* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(bias_c.numel() == N, "bias must have ", N, " elements");
    b = bias_c.data_ptr<bf16>();
  }
  auto out = output_for(out_buffer, {M, N}, x, "pairs_linear");
  if (M == 0) return out;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t xs = x.stride(0);
  const int NT = blocks_per_item(blocks);
  const bool hw = !emulate && pairs_hardware();
  at::parallel_for(0, blocks / NT, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t first = item * NT;
#if defined(PM_PAIRS_HW)
      if (hw) {
        switch (NT) {
          case 3: hw_item<3, 8>(xp, xs, M, K, wp, b, op, N, first); break;
          case 2: hw_item<2, 12>(xp, xs, M, K, wp, b, op, N, first); break;
          default: hw_item<1, 12>(xp, xs, M, K, wp, b, op, N, first); break;
        }
        continue;
      }
#endif
      (void)hw;
      for (int64_t blk = first; blk < first + NT; ++blk)
        emulated_item(xp, xs, M, K, wp, b, op, N, blk);
    }
  });
  return out;
}

}  // namespace pm
