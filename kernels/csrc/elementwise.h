// The per-layer elementwise kernels: RMSNorm with its residual add, RoPE with the KV-cache
// write, SiLU with its multiply.
//
// No include guard: kernels/csrc/cpu_ops.cpp includes this file twice, into two namespaces.
// `plain_cvt` converts to bfloat16 with ATen's vectors (integer arithmetic, any CPU).
// `native_cvt`, in the AVX-512 builds only, is compiled for AVX-512 BF16 and converts pairs of
// vectors with one vcvtne2ps2bf16 (its own store2 and round2 hide the outer ones); it runs
// where the CPU has the instruction. Everything else here is shared, so both give the same
// bits (tests/test_cpu_ops.py checks it).

// ---------------------------------------------------------------- RMSNorm (+ residual add)
// out = weight * T(x / rms(x)) with x in float32, as Hugging Face orders it. With a residual,
// first residual = T(residual + x) in place (the decoder's skip connection), and normalize that.
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n,
                   int64_t x_stride, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* rr = residual ? residual + r * n : nullptr;
      fVec ss(0.f);
      int64_t i = 0;
      for (; i + 2 * W <= n; i += 2 * W) {
        fVec a, b;
        load2(xr + i, a, b);
        if (rr) {
          fVec ra, rb;
          load2(rr + i, ra, rb);
          a = a + ra;
          b = b + rb;
          round2<T>(a, b);  // the residual as the model stores it
          store2(rr + i, a, b);
        }
        a.store(buf.data() + i);
        b.store(buf.data() + i + W);
        ss = at::vec::fmadd(b, b, at::vec::fmadd(a, a, ss));  // a first, as one at a time
      }
      for (; i + W <= n; i += W) {
        fVec v = loadf(xr + i);
        if (rr) {
          storef(rr + i, v + loadf(rr + i));
          v = loadf(rr + i);  // rounded to T as the model would store it
        }
        v.store(buf.data() + i);
        ss = at::vec::fmadd(v, v, ss);
      }
      float sum = hsum(ss);
      for (; i < n; ++i) {
        float v = to_float(xr[i]);
        if (rr) {
          rr[i] = static_cast<T>(v + to_float(rr[i]));
          v = to_float(rr[i]);
        }
        buf[i] = v;
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / n + eps);
      T* o = out + r * n;
      const fVec inv_v(inv);
      for (i = 0; i + 2 * W <= n; i += 2 * W) {
        fVec a = fVec::loadu(buf.data() + i) * inv_v;
        fVec b = fVec::loadu(buf.data() + i + W) * inv_v;
        round2<T>(a, b);  // the normalized row in T, as Hugging Face rounds it
        fVec wa, wb;
        load2(weight + i, wa, wb);
        store2(o + i, wa * a, wb * b);
      }
      for (; i + W <= n; i += W)
        storef(o + i, loadf(weight + i) * round_to<T>(fVec::loadu(buf.data() + i) * inv_v));
      for (; i < n; ++i) {
        const T normed = static_cast<T>(buf[i] * inv);
        o[i] = static_cast<T>(to_float(weight[i]) * to_float(normed));
      }
    }
  });
}

// ---------------------------------------------------------------- RoPE + KV-cache write
// qkv: [T, (H + 2 KVH) * D], the fused projection's output. Rotates the query and key heads in
// place (rotate-half RoPE, Hugging Face's Llama convention) with float32 cos/sin tables of
// [positions, D / 2], then copies each token's key and value rows into their cache slot.
template <typename T>
void rope_write(T* qkv, int64_t tokens, int64_t stride, const int64_t* pos, const float* cos,
                const float* sin, int64_t H, int64_t KVH, int64_t D, T* kc, T* vc,
                const int64_t* slots, int64_t BS, int64_t kblock, int64_t step,
                int64_t head) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, grain_rows(stride), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * stride;
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < H + KVH; ++h) {
        T* x = row + h * D;
        int64_t i = 0;
        // Two vectors at a time where the half-row allows: one bfloat16/float16 conversion for
        // both (head_dim 64 under AVX-512: the whole half-row; 3x faster on bfloat16).
        for (; i + 2 * W <= half; i += 2 * W) {
          fVec x1a, x1b, x2a, x2b;
          load2(x + i, x1a, x1b);
          load2(x + half + i, x2a, x2b);
          const fVec ca = fVec::loadu(c + i), cb = fVec::loadu(c + i + W);
          const fVec sa = fVec::loadu(s + i), sb = fVec::loadu(s + i + W);
          store2(x + i, x1a * ca - x2a * sa, x1b * cb - x2b * sb);
          store2(x + half + i, x2a * ca + x1a * sa, x2b * cb + x1b * sb);
        }
        for (; i + W <= half; i += W) {
          const fVec x1 = loadf(x + i), x2 = loadf(x + half + i);
          const fVec cv = fVec::loadu(c + i), sv = fVec::loadu(s + i);
          storef(x + i, x1 * cv - x2 * sv);
          storef(x + half + i, x2 * cv + x1 * sv);
        }
        for (; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
          x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          x[half + i] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
      if (slots[t] < 0) continue;  // padding
      // Keys token-minor (kblock > 0: element d of head h at h * D * BS + d * BS in the slot's
      // block), or, as the values always, head h's row at offset * step + h * head (rows: step
      // KVH * D, head D; head-major: step D, head BS * D).
      const int64_t kv = KVH * D, block = BS * kv;
      const T* k_src = row + H * D;
      const T* v_src = k_src + kv;
      const int64_t at = slots[t] / BS * block, j = slots[t] % BS;
      if (kblock > 0) {
        T* k = kc + at + j;
        for (int64_t e = 0; e < kv; ++e) k[e * BS] = k_src[e];
      }
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t to = at + j * step + h * head;
        if (kblock == 0) std::copy(k_src + h * D, k_src + (h + 1) * D, kc + to);
        std::copy(v_src + h * D, v_src + (h + 1) * D, vc + to);
      }
    }
  });
}

// ---------------------------------------------------------------- SiLU and multiply
// gate_up: [T, 2I] -> [T, I], silu(gate) * up, in float32.
template <typename T>
void silu_mul_rows(const T* in, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain_rows(3 * inter), [&](int64_t begin, int64_t end) {
    const fVec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
      for (; i + 2 * W <= inter; i += 2 * W) {
        fVec xa, xb, ua, ub;
        load2(g + i, xa, xb);
        load2(u + i, ua, ub);
        store2(o + i, xa / (one + exp_for<T>(xa.neg())) * ua,
               xb / (one + exp_for<T>(xb.neg())) * ub);
      }
      for (; i + W <= inter; i += W) {
        const fVec x = loadf(g + i);
        storef(o + i, x / (one + exp_for<T>(x.neg())) * loadf(u + i));
      }
      for (; i < inter; ++i) {
        const float x = to_float(g[i]);
        o[i] = static_cast<T>(x / (1.f + std::exp(-x)) * to_float(u[i]));
      }
    }
  });
}
