// Where a kernel writes its result: a new tensor, or the caller's `out` (a buffer the model
// reuses for every layer of a forward pass, so that a decode step does not allocate ~250
// tensors: docs/kernels.md, "Output buffers").
#pragma once

#include <torch/extension.h>

namespace pm {

// `out` when given, checked to be a contiguous tensor of `sizes` and `like`'s dtype and device;
// else a new one.
inline at::Tensor output_for(const c10::optional<at::Tensor>& out, at::IntArrayRef sizes,
                             const at::Tensor& like, const char* op) {
  if (!out.has_value() || !out->defined()) return at::empty(sizes, like.options());
  const at::Tensor& o = *out;
  TORCH_CHECK(o.sizes() == sizes, op, ": out must be ", sizes, ", got ", o.sizes());
  TORCH_CHECK(o.scalar_type() == like.scalar_type() && o.device() == like.device(), op,
              ": out must be ", like.scalar_type(), " on ", like.device(), ", got ",
              o.scalar_type(), " on ", o.device());
  TORCH_CHECK(o.is_contiguous(), op, ": out must be contiguous");
  return o;
}

}  // namespace pm
