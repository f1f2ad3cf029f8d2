// The block product of lowbit_linear.cpp and the int8 product of int8_linear.cpp, for the other
// kernels of the library to call.

#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace seqgate {

// The kinds of block weights (engine.model.lowbit.BlockLinear.kind): Q4_1, Q8_0, and 16-bit
// values (bf16 or fp16; `q` then holds them and `d`, `m` are unused); int8 weights for int8
// arithmetic (engine.model.w8a8: `q` [in, out] int8, `d` one fp32 scale per output); and the
// layer's dense weights for forwards beyond the block kernel's rows: `q` the weight [out, in]
// multiplied as F.linear does (kDense), or oneDNN's prepacked copy of it
// (engine.model.onednn.pack, kOnednn); and Q4_1 blocks in tiles of 8 output rows or Q8_0 blocks
// multiplied by rows rounded to 8 bits (q8_rows.cpp: kQ4x8Q8, kQ8Q8), for the formats that were
// rounded already, and Q8_0 blocks in tiles of 8 output rows times such rows (kQ8x8Q8).
constexpr int64_t kQ4 = 0, kQ8 = 1, kH16 = 2, kInt8 = 3, kDense = 4, kOnednn = 5, kQ4x8Q8 = 6,
                  kQ8Q8 = 7, kQ8x8Q8 = 8;

// x [rows, in] (float32 or bfloat16) times the weights in blocks -> [rows, out], x's dtype.
at::Tensor block_product(const at::Tensor& x, int64_t kind, const at::Tensor& q,
                         const std::optional<at::Tensor>& d, const std::optional<at::Tensor>& m);

// x [rows, in] (float32 or bfloat16) times Q4_1 blocks in tiles of 8 output rows (q, d, m) or
// Q8_0 blocks (q, d), each row rounded to 8 bits per block of 32 columns and the products
// summed in integers (q8_rows.cpp) -> [rows, out], x's dtype.
at::Tensor q4x8_q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                          const at::Tensor& m);
at::Tensor q8_q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d);
at::Tensor q8x8_q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d);

// x [rows, in] (float32 or bfloat16, contiguous) times int8 `weight` [in, out] with one fp32
// scale per output channel, each row quantised with its own scale -> [rows, out], x's dtype.
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& bias);

// A Llama layer's work before and after its attention over int8 weights (kInt8), in few
// passes (int8_linear.cpp); `int8_layer_fits` says whether the shapes fit them: hidden
// [rows, tokens, cols], fp32 or bf16, and whole vectors in its columns, in each half of a head
// (head_dim; 0 where not asked) and in each half of `weight`'s outputs (the stacked query, key
// and value projection, or gate and up).
bool int8_layer_fits(const at::Tensor& hidden, int64_t head_dim, const at::Tensor& weight);

std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_attention_inputs(
    const at::Tensor& hidden, const at::Tensor& norm, double eps, const at::Tensor& weight,
    const at::Tensor& scales, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
    const at::Tensor& cos, const at::Tensor& signed_sin);

at::Tensor int8_attention_output(const at::Tensor& attention, const at::Tensor& residual,
                                 const at::Tensor& o_weight, const at::Tensor& o_scales,
                                 const at::Tensor& norm, double eps,
                                 const at::Tensor& gate_up_weight,
                                 const at::Tensor& gate_up_scales, const at::Tensor& down_weight,
                                 const at::Tensor& down_scales);

}  // namespace seqgate
