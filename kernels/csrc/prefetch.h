// A cache line asked for ahead of use, shared by the attention kernels (cpu_ops.cpp) and the
// panel GEMM (panel_gemm.cpp).
#pragma once

namespace pm {

// Into the L2, not the L1 (locality 2: prefetcht1). A decode step's KV comes from memory, and
// the L1's few outstanding misses fill up with a burst of a block's lines: demand loads then
// wait behind them, and the kernel's arithmetic and its reads stop overlapping. Into the L2,
// the same kernel ran 1.25-1.4x faster from memory (docs/benchmarks.md), and no slower hot.
inline void prefetch(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace pm
