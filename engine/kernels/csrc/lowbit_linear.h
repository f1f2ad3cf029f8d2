// The block product of lowbit_linear.cpp, for the other kernels of the library to call.

#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace seqgate {

// The kinds of block weights (engine.model.lowbit.BlockLinear.kind): Q4_1, Q8_0, and 16-bit
// values (bf16 or fp16; `q` then holds them and `d`, `m` are unused).
constexpr int64_t kQ4 = 0, kQ8 = 1, kH16 = 2;

// x [rows, in] (float32 or bfloat16) times the weights in blocks -> [rows, out], x's dtype.
at::Tensor block_product(const at::Tensor& x, int64_t kind, const at::Tensor& q,
                         const std::optional<at::Tensor>& d, const std::optional<at::Tensor>& m);

}  // namespace seqgate
