// float32 GEMM on the widest FMA vectors, for the linear layers of float32 models.
//
// out[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n]), float32 in, out and in the sums.
//
// Why our own: float32 is the default dtype on CPUs without native bfloat16 (AVX2 machines),
// where the linear layers are three quarters of a decode step. oneDNN's float32 inner product
// reaches 60-75% of the FMA units' peak at SmolLM2's shapes (docs/benchmarks.md) and costs a
// primitive lookup per call; the loop below keeps the units busier and streams each weight once
// per call at any row count.
//
// Layout: the weight [N, K] is packed once into panels [N / W][K][W] (W = floats in a vector
// of this build: 8 under AVX2, 16 under AVX-512): for each block of W output features, for
// each input k, the W features' weights side by side, so one vector load is one operand of an
// FMA. A work item is NT blocks; for MR rows at a time it keeps MR x NT vector accumulators in
// registers, and for each input k loads NT weight vectors, broadcasts each row's x[m][k] and
// multiplies it in. Items are spread over the threads; each streams its own panels once from
// memory, then from cache for the next MR rows. While a thread computes an item it asks for its
// next item's panels (into the L2, a share during each row tile), so that the next item's
// first rows find them there instead of waiting on memory.
//
// Written against ATen's portable vectors, so each ISA build (kernels/cpu_ops.py) compiles it
// for its own width, and the plain build runs the same loop on any CPU. Every row is summed in
// the same order (k = 0, 1, ..., K - 1, one FMA chain per output) whatever the number of rows
// or threads, so a row's result never depends on what it is batched with.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <atomic>

#include "output.h"
#include "prefetch.h"

namespace pm {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t W = fVec::size();

// Rows per register tile, and blocks per work item where the block count allows: MR x 3
// accumulators, 3 weight vectors and a broadcast fill the register file: 4 x 3 + 4 = 16 under
// AVX2 (4 x 3 ran as fast as 6 x 2 at 64 rows and 5-40% faster at 1-16, docs/benchmarks.md),
// 8 x 3 + 4 = 28 of 32 under AVX-512.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int MR = 8;
#else
constexpr int MR = 4;
#endif
constexpr int NT_MAX = 3;

// Calls of MR + 1 to ONE_PASS_MAX_ROWS rows take all their rows in one tile per item, of 2
// panels (6 x 2 accumulators + 2 weights + a broadcast fit AVX2's 16 registers), instead of a
// tile of MR rows on 3 panels and a second tile for the rest. A few rows are bound by the
// weights' read from memory, and the second tile read the panels again, from the L2, after the
// first had waited on memory for them: now each panel is read once. Measured on AVX2
// (docs/benchmarks.md, "Five and six rows in one pass"), 30 layers' weights read cold: 5 rows
// 1.08-1.16x, 6 rows 1.09-1.11x; at 7-8 rows only one panel fits the registers, and items of
// one panel streamed slower (0.89-0.97x). Not measured on AVX-512 (where MR is 8), so only the
// AVX2 build does this.
#if defined(CPU_CAPABILITY_AVX2)
constexpr int ONE_PASS_MAX_ROWS = 6;
#else
constexpr int ONE_PASS_MAX_ROWS = 0;
#endif

// Calls of fewer rows than this do not ask for the next item's panels: with few rows an item
// computes for less time than the next one's read from memory takes, it is bound by its own
// reads, and the next item's compete with them. Measured on AVX2 (docs/benchmarks.md, "Panels
// asked for ahead"), 30 layers' weights read cold, not asking against asking: 4 rows 0.78x,
// 8 rows 0.95x, 12 rows 1.09x, 16 rows 1.06x, 24 rows 1.2x, 64 rows 1.1x.
constexpr int64_t AHEAD_MIN_ROWS = 12;

// The next item's panels as a tile asks for them: `lines` cache lines from `next`, spread over
// the tile's inputs (a few every `every` inputs).
struct Ahead {
  const char* next = nullptr;
  int64_t lines = 0;
};

// Whether items ask for the next item's panels (set_panel_ahead: off only for A/B runs).
std::atomic<bool> g_ahead{true};

inline int blocks_per_item(int64_t blocks) {
  for (int nt = NT_MAX; nt > 1; --nt)
    if (blocks % nt == 0) return nt;
  return 1;
}

// R rows x NT blocks of the output, every input k.
template <int R, int NT>
inline void tile(const float* x, int64_t x_stride, int64_t K, const float* w, const float* bias,
                 float* out, int64_t out_stride, Ahead ahead) {
  fVec acc[R][NT];
  for (int m = 0; m < R; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = fVec(0.f);
  const float* wt[NT];
  for (int t = 0; t < NT; ++t) wt[t] = w + t * K * W;
  const int64_t every = ahead.lines > 0 ? std::max<int64_t>(1, K / ahead.lines) : K + 1;
  const int64_t burst = (ahead.lines + K - 1) / K;
  int64_t countdown = every;
  for (int64_t k = 0; k < K; ++k) {
    if (--countdown == 0) {
      countdown = every;
      for (int64_t j = 0; j < burst && ahead.lines > 0; ++j, --ahead.lines, ahead.next += 64)
        prefetch(ahead.next);  // into the L2
    }
    fVec wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = fVec::loadu(wt[t] + k * W);
    for (int m = 0; m < R; ++m) {
      const fVec a(x[m * x_stride + k]);
      for (int t = 0; t < NT; ++t) acc[m][t] = at::vec::fmadd(a, wv[t], acc[m][t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const fVec b = bias ? fVec::loadu(bias + t * W) : fVec(0.f);
    for (int m = 0; m < R; ++m) {
      const fVec v = bias ? acc[m][t] + b : acc[m][t];
      v.store(out + m * out_stride + t * W);
    }
  }
}

// The last `rows` (< MR) rows of an item, with a tile of exactly that many rows.
template <int NT, int R = 1>
void tail(int64_t rows, const float* x, int64_t x_stride, int64_t K, const float* w,
          const float* bias, float* out, int64_t out_stride, Ahead ahead) {
  if constexpr (R < MR) {
    if (rows == R) return tile<R, NT>(x, x_stride, K, w, bias, out, out_stride, ahead);
    return tail<NT, R + 1>(rows, x, x_stride, K, w, bias, out, out_stride, ahead);
  }
}

// Blocks [first_block, first_block + NT) of every row; `has_next`: the thread's next item is
// the next NT blocks, whose panels it asks for meanwhile.
template <int NT>
void item(const float* x, int64_t x_stride, int64_t M, int64_t K, const float* panels,
          const float* bias, float* out, int64_t N, int64_t first_block, bool has_next) {
  const float* w = panels + first_block * K * W;
  const int64_t n0 = first_block * W;
  const float* b = bias ? bias + n0 : nullptr;
  const int64_t tiles = (M + MR - 1) / MR;
  const int64_t bytes = NT * K * W * int64_t(sizeof(float));
  int64_t left = has_next && M >= AHEAD_MIN_ROWS ? (bytes + 63) / 64 : 0;
  const int64_t per_tile = (left + tiles - 1) / tiles;
  Ahead ahead{reinterpret_cast<const char*>(w + NT * K * W), 0};
  int64_t m = 0;
  for (; m + MR <= M; m += MR) {
    ahead.lines = std::min(per_tile, left);
    tile<MR, NT>(x + m * x_stride, x_stride, K, w, b, out + m * N + n0, N, ahead);
    ahead.next += ahead.lines * 64;
    left -= ahead.lines;
  }
  ahead.lines = std::min(per_tile, left);
  if (m < M) tail<NT>(M - m, x + m * x_stride, x_stride, K, w, b, out + m * N + n0, N, ahead);
}

// Every one of the call's R = M rows in one tile per item of 2 blocks (see ONE_PASS_MAX_ROWS).
template <int R = MR + 1>
void one_pass(int64_t M, const float* x, int64_t xs, int64_t K, const float* panels,
              const float* bias, float* out, int64_t N, int64_t blocks) {
  if constexpr (R <= ONE_PASS_MAX_ROWS) {
    if (M != R) return one_pass<R + 1>(M, x, xs, K, panels, bias, out, N, blocks);
    at::parallel_for(0, blocks / 2, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        tile<R, 2>(x, xs, K, panels + 2 * i * K * W, bias ? bias + 2 * i * W : nullptr,
                   out + 2 * i * W, N, Ahead());
    });
  }
}

}  // namespace

int64_t panel_width() { return W; }

bool set_panel_ahead(bool on) { return g_ahead.exchange(on); }

at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "weight must be a 2-D float32 [out, in] tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % W == 0, "panel packing needs out features a multiple of ", W, " (got ", N, ")");
  const auto w = weight.contiguous();
  auto packed = at::empty({N / W, K, W}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, N / W, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < W; ++j) dst[(b * K + k) * W + j] = src[(b * W + j) * K + k];
  });
  return packed;
}

at::Tensor panels_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                         c10::optional<at::Tensor> out_buffer) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x must be 2-D float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == W && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed must come from pack_panels of this build (", W, " floats a panel)");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * W;
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the weight ", packed.size(1));
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_c.numel() == N, "bias must have ", N, " elements");
    b = bias_c.data_ptr<float>();
  }
  auto out = output_for(out_buffer, {M, N}, x, "panels_linear");
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  if (M > MR && M <= ONE_PASS_MAX_ROWS && blocks % 2 == 0) {
    one_pass(M, xp, xs, K, wp, b, op, N, blocks);
    return out;
  }
  const int NT = blocks_per_item(blocks);
  const bool ahead = g_ahead.load(std::memory_order_relaxed);
  at::parallel_for(0, blocks / NT, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const bool has_next = ahead && i + 1 < i1;
      switch (NT) {
        case 3: item<3>(xp, xs, M, K, wp, b, op, N, i * 3, has_next); break;
        case 2: item<2>(xp, xs, M, K, wp, b, op, N, i * 2, has_next); break;
        default: item<1>(xp, xs, M, K, wp, b, op, N, i, has_next); break;
      }
    }
  });
  return out;
}

}  // namespace pm
