// A Llama decoder layer's work before and after its attention, for forwards of few rows whose
// linear layers are in blocks, and for forwards of many rows in int8 arithmetic
// (engine.model.llama_layers' lean forward, its native path).
//
// At one row the operators of a layer are tiny, and their cost is the calls: from Python each
// takes 2-3 µs of interpreter and dispatch, about half of a one-row step outside the weights'
// products (docs/benchmarks/speed.md). At many rows the calls are a smaller share, but the
// interpreter holds one of the cores while the other waits: on 2 cores the Python of a step is
// serial time. These two functions run the same ATen operators on the
// same tensors in the same order as the Python forward, so their results are equal bit for bit
// (tests/engine/test_lowbit.py), and only the calls from Python go away. Layers in int8 are the
// exception: their work between the products runs in fused passes (int8_linear.cpp), close to
// the Python forward but not equal to it (tests/engine/test_w8a8.py). The KV cache update and
// the attention stay in Python between them: they are the model's and the engine's own.
//
// Each linear layer is (kind, q, d, m) as engine.model.lowbit.BlockLinear holds it, or
// (kInt8, weight, scales, None) as engine.model.w8a8.W8A8Linear's packed weights, without a
// bias; `block_product` multiplies it.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "lowbit_linear.h"

namespace {

// LlamaRMSNorm's forward, operation for operation (llama_layers._rms_norm).
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  at::Tensor x = hidden.to(at::kFloat);
  const at::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
  x = x * at::rsqrt(variance + eps);
  return weight * x.to(hidden.scalar_type());
}

// BlockLinear.forward on its kernel path: rows flattened, multiplied, shaped back.
at::Tensor product(const at::Tensor& x, int64_t kind, const at::Tensor& q,
                   const std::optional<at::Tensor>& d, const std::optional<at::Tensor>& m) {
  const at::Tensor out =
      seqgate::block_product(x.reshape({-1, x.size(-1)}).contiguous(), kind, q, d, m);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out.size(1);
  return out.view(shape);
}

// The input norm, the stacked query/key/value projection and the rotary embedding of the query
// and key heads (llama_layers.lean_forward with stacked projections; `signed_sin` is
// llama_layers._rotary_tables' sin, its first half negated). Returns query, key, value, each
// [rows, heads, tokens, head_dim] as the Python forward's views.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lean_attention_inputs(
    const at::Tensor& hidden, const at::Tensor& norm, double eps, int64_t kind,
    const at::Tensor& q, const std::optional<at::Tensor>& d, const std::optional<at::Tensor>& m,
    int64_t q_heads, int64_t kv_heads, int64_t head_dim, const at::Tensor& cos,
    const at::Tensor& signed_sin) {
  if (kind == seqgate::kInt8 && d.has_value() &&
      seqgate::int8_layer_fits(hidden, head_dim, q))
    return seqgate::int8_attention_inputs(hidden, norm, eps, q, *d, q_heads, kv_heads, head_dim,
                                          cos, signed_sin);
  const at::Tensor x = rms_norm(hidden, norm, eps);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(-1);
  shape.push_back(head_dim);
  const at::Tensor qkv = product(x, kind, q, d, m).view(shape).transpose(1, 2);
  const int64_t heads = q_heads + kv_heads;
  const at::Tensor both = qkv.slice(1, 0, heads);
  const at::Tensor turned = both * cos + at::roll(both, {both.size(-1) / 2}, {-1}) * signed_sin;
  return {turned.slice(1, 0, q_heads), turned.slice(1, q_heads), qkv.slice(1, heads)};
}

// The rest of the layer after its attention: the output projection and the residual, the
// post-attention norm, the stacked gate/up projection, SiLU, the down projection and the
// residual. `attention` is the attention function's output, `residual` the layer's input.
at::Tensor lean_attention_output(
    const at::Tensor& attention, const at::Tensor& residual, int64_t o_kind,
    const at::Tensor& o_q, const std::optional<at::Tensor>& o_d,
    const std::optional<at::Tensor>& o_m, const at::Tensor& norm, double eps,
    int64_t gate_up_kind, const at::Tensor& gate_up_q, const std::optional<at::Tensor>& gate_up_d,
    const std::optional<at::Tensor>& gate_up_m, int64_t down_kind, const at::Tensor& down_q,
    const std::optional<at::Tensor>& down_d, const std::optional<at::Tensor>& down_m) {
  if (o_kind == seqgate::kInt8 && gate_up_kind == seqgate::kInt8 &&
      down_kind == seqgate::kInt8 && o_d.has_value() && gate_up_d.has_value() &&
      down_d.has_value() && seqgate::int8_layer_fits(residual, 0, gate_up_q))
    return seqgate::int8_attention_output(attention, residual, o_q, *o_d, norm, eps, gate_up_q,
                                          *gate_up_d, down_q, *down_d);
  std::vector<int64_t> shape(residual.sizes().begin(), residual.sizes().end() - 1);
  shape.push_back(-1);
  const at::Tensor out = attention.reshape(shape).contiguous();
  const at::Tensor hidden = residual + product(out, o_kind, o_q, o_d, o_m);
  const at::Tensor x = rms_norm(hidden, norm, eps);
  const std::vector<at::Tensor> gate_up =
      product(x, gate_up_kind, gate_up_q, gate_up_d, gate_up_m).chunk(2, -1);
  return hidden + product(at::silu(gate_up[0]) * gate_up[1], down_kind, down_q, down_d, down_m);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seqgate, m) {
  m.def("lean_attention_inputs(Tensor hidden, Tensor norm, float eps, int kind, Tensor q, "
        "Tensor? d, Tensor? m, int q_heads, int kv_heads, int head_dim, Tensor cos, "
        "Tensor signed_sin) -> (Tensor, Tensor, Tensor)");
  m.def("lean_attention_output(Tensor attention, Tensor residual, int o_kind, Tensor o_q, "
        "Tensor? o_d, Tensor? o_m, Tensor norm, float eps, int gate_up_kind, Tensor gate_up_q, "
        "Tensor? gate_up_d, Tensor? gate_up_m, int down_kind, Tensor down_q, Tensor? down_d, "
        "Tensor? down_m) -> Tensor");
}

TORCH_LIBRARY_IMPL(seqgate, CPU, m) {
  m.impl("lean_attention_inputs", &lean_attention_inputs);
  m.impl("lean_attention_output", &lean_attention_output);
}

// oneDNN's prepacked weights (kOnednn) are tensors of their own backend, which the dispatcher
// picks for a call that passes one.
TORCH_LIBRARY_IMPL(seqgate, MkldnnCPU, m) {
  m.impl("lean_attention_inputs", &lean_attention_inputs);
  m.impl("lean_attention_output", &lean_attention_output);
}
