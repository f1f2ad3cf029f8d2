// A Llama decoder layer's work before and after its attention, for forwards of few rows whose
// linear layers are in blocks, and for forwards of many rows in int8 arithmetic
// (engine.model.llama_layers' lean forward, its native path).
//
// At one row the operators of a layer are tiny, and their cost is the calls: from Python each
// takes 2-3 µs of interpreter and dispatch, about half of a one-row step outside the weights'
// products (docs/benchmarks/speed.md). At many rows the calls are a smaller share, but the
// interpreter holds one of the cores while the other waits: on 2 cores the Python of a step is
// serial time. These two functions compute what the Python forward's operators compute, in
// the same order and with the same roundings, so their results are equal bit for bit
// (tests/engine/test_lowbit.py), and only the calls go away: for layers in blocks the work
// between the products runs in passes over the rows, else as ATen operators. Layers in int8
// are the exception: their work between the products runs in fused passes (int8_linear.cpp),
// close to the Python forward but not equal to it (tests/engine/test_w8a8.py). The KV cache
// update and the attention stay in Python between them: they are the model's and the engine's
// own.
//
// Each linear layer is (kind, q, d, m) as engine.model.lowbit.BlockLinear holds it, or
// (kInt8, weight, scales, None) as engine.model.w8a8.W8A8Linear's packed weights, without a
// bias; `block_product` multiplies it.

#include <ATen/TensorOperators.h>
#include <ATen/TensorIterator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "lowbit_linear.h"
#include "vec.h"

namespace {

using namespace seqgate;

// One linear layer's weights as the library takes them (kind, q, d, m: lowbit_linear.h).
struct Linear {
  int64_t kind;
  const at::Tensor& q;
  const std::optional<at::Tensor>& d;
  const std::optional<at::Tensor>& m;
  // x's rows ([rows, in], contiguous) times the weights.
  at::Tensor times(const at::Tensor& x) const { return block_product(x, kind, q, d, m); }
  // BlockLinear.forward on its kernel path: rows flattened, multiplied, shaped back.
  at::Tensor operator()(const at::Tensor& x) const {
    const at::Tensor out = times(x.reshape({-1, x.size(-1)}).contiguous());
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out.size(1);
    return out.view(shape);
  }
};

// LlamaRMSNorm's forward, operation for operation (llama_layers._rms_norm).
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  at::Tensor x = hidden.to(at::kFloat);
  const at::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
  x = x * at::rsqrt(variance + eps);
  return weight * x.to(hidden.scalar_type());
}

// -- Layers in blocks: the work between the products in passes over the rows ------------------
//
// At one row the ATen operators between a layer's products (norms, rotary embedding, SiLU,
// residuals) cost their dispatch and a new tensor each, about 25 a layer: a fifth of a one-row
// step on 2 cores (docs/benchmarks/speed.md). These passes do each element's arithmetic as those
// operators do, rounding to the model's dtype where they round (the build lets the compiler fuse
// no product and sum), and leave the norms' sums of squares to ATen's reduction, whose order of
// additions they would otherwise have to copy: the results stay equal bit for bit.

// Whether the passes take a forward of `hidden` whose products are of `kind`: [rows, tokens,
// cols] in fp32 or bf16, whole vectors in its columns and in each half of a head, and a norm
// weight of its size and dtype. Shapes the layer's products would refuse are left to them.
bool passes_fit(const at::Tensor& hidden, int64_t kind, int64_t head_dim,
                const at::Tensor& norm) {
  return (kind == kQ4 || kind == kQ8 || kind == kH16 || kind == kQ4x8Q8 || kind == kQ8Q8 ||
          kind == kQ8x8Q8) &&
         hidden.dim() == 3 &&
         (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16) &&
         hidden.size(-1) % kLanes == 0 && head_dim % (2 * kLanes) == 0 &&
         norm.numel() == hidden.size(-1) && norm.scalar_type() == hidden.scalar_type();
}

constexpr int64_t kRowGrain = 16;  // rows a thread takes in the passes: a step's few stay on one
// ATen's SiLU computes whole runs of two vectors (up to 64 bf16 values) with its vectorised exp
// and the rest with std::exp, and splits a tensor over threads from GRAIN_SIZE elements on: the
// pass's vectorised exp equals it where every row is whole runs and no split falls in a row.
constexpr int64_t kSiluVector = 64;

// LlamaRMSNorm of h's rows ([m, cols], contiguous T) with `weight` (llama_layers._rms_norm).
template <typename T>
at::Tensor norm_rows(const at::Tensor& h, const at::Tensor& weight, double eps) {
  const int64_t m = h.size(0), cols = h.size(1);
  at::Tensor squares = at::empty({m, cols}, h.options().dtype(at::kFloat));
  const T* hp = h.const_data_ptr<T>();
  float* sp = squares.data_ptr<float>();
  at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * cols; i < end * cols; i += kLanes) {
      const Vec v = load(hp + i);
      (v * v).store(sp + i);
    }
  });
  const at::Tensor variance = squares.mean(-1);  // x.pow(2).mean(-1): ATen's own sums
  const float* vp = variance.const_data_ptr<float>();
  const at::Tensor w = weight.contiguous();
  const T* wp = w.const_data_ptr<T>();
  at::Tensor out = at::empty({m, cols}, h.options());
  T* op = out.data_ptr<T>();
  at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Vec inv = Vec(vp[r] + static_cast<float>(eps)).rsqrt();  // torch.rsqrt: 1 / sqrt
      for (int64_t c = 0; c < cols; c += kLanes)
        store(op + r * cols + c, load(wp + c) * round_to<T>(load(hp + r * cols + c) * inv));
    }
  });
  return out;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_inputs(
    const at::Tensor& hidden, const at::Tensor& norm, double eps, const Linear& projection,
    int64_t q_heads, int64_t kv_heads, int64_t head_dim, const at::Tensor& cos,
    const at::Tensor& signed_sin) {
  const int64_t batch = hidden.size(0), tokens = hidden.size(1), cols = hidden.size(2);
  const int64_t rows = batch * tokens;
  const at::Tensor x = norm_rows<T>(hidden.reshape({rows, cols}).contiguous(), norm, eps);
  at::Tensor qkv = projection.times(x);  // a new tensor: turned in place
  const int64_t n = qkv.size(1), turned = (q_heads + kv_heads) * head_dim, half = head_dim / 2;
  // [batch, tokens, head_dim] views of the tables ([rows or 1, 1, tokens, head_dim]).
  const at::Tensor cs = cos.contiguous().expand({batch, 1, tokens, head_dim}).select(1, 0);
  const at::Tensor sn = signed_sin.contiguous().expand({batch, 1, tokens, head_dim}).select(1, 0);
  const T* cp = cs.const_data_ptr<T>();
  const T* snp = sn.const_data_ptr<T>();
  T* xp = qkv.data_ptr<T>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / tokens, t = r % tokens;
      const T* c = cp + b * cs.stride(0) + t * cs.stride(1);
      const T* s = snp + b * sn.stride(0) + t * sn.stride(1);
      for (int64_t head = 0; head < turned; head += head_dim)  // turned in place
        rotate_head(xp + r * n + head, xp + r * n + head, c, s, half);
    }
  });
  const at::Tensor heads = qkv.view({batch, tokens, -1, head_dim}).transpose(1, 2);
  return {heads.slice(1, 0, q_heads), heads.slice(1, q_heads, q_heads + kv_heads),
          heads.slice(1, q_heads + kv_heads)};
}

// into[i] = a[i] + into[i] (the model's `residual + product`), rounded to T.
template <typename T>
void add_into(const at::Tensor& a, at::Tensor& into) {
  const T* ap = a.const_data_ptr<T>();
  T* ip = into.data_ptr<T>();
  for (int64_t i = 0; i < into.numel(); i += kLanes) store(ip + i, load(ap + i) + load(ip + i));
}

template <typename T>
at::Tensor block_output(const at::Tensor& attention, const at::Tensor& residual, const Linear& o,
                        const at::Tensor& norm, double eps, const Linear& gate_up_projection,
                        const Linear& down) {
  const int64_t cols = residual.size(-1), rows = residual.numel() / cols;
  const at::Tensor res = residual.reshape({rows, cols}).contiguous();
  at::Tensor hidden = o.times(attention.reshape({rows, -1}).contiguous());
  add_into<T>(res, hidden);
  const at::Tensor gate_up = gate_up_projection.times(norm_rows<T>(hidden, norm, eps));
  const int64_t inner = gate_up.size(1) / 2;
  at::Tensor act;
  if (inner % kSiluVector == 0 && rows * inner <= at::internal::GRAIN_SIZE) {
    act = at::empty({rows, inner}, hidden.options());
    const T* gp = gate_up.const_data_ptr<T>();
    T* ap = act.data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inner; c += kLanes)  // F.silu(gate) * up, each rounded to T
        store(ap + r * inner + c, round_to<T>(silu(load(gp + r * 2 * inner + c))) *
                                      load(gp + r * 2 * inner + inner + c));
  } else {  // where ATen's SiLU would take its scalar exp for some elements
    const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    act = at::silu(halves[0]) * halves[1];
  }
  at::Tensor out = down.times(act);
  add_into<T>(hidden, out);
  return out.view(residual.sizes());
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
  if (kind == kInt8 && d.has_value() &&
      int8_layer_fits(hidden, head_dim, q))
    return int8_attention_inputs(hidden, norm, eps, q, *d, q_heads, kv_heads, head_dim, cos,
                                 signed_sin);
  if (passes_fit(hidden, kind, head_dim, norm) && cos.scalar_type() == hidden.scalar_type() &&
      signed_sin.scalar_type() == hidden.scalar_type() &&
      q.size(0) >= (q_heads + kv_heads) * head_dim)
    return SEQGATE_DISPATCH_FLOAT_BF16(hidden.scalar_type(), "lean_attention_inputs", [&] {
      return block_inputs<scalar_t>(hidden, norm, eps, {kind, q, d, m}, q_heads, kv_heads,
                                    head_dim, cos, signed_sin);
    });
  const at::Tensor x = rms_norm(hidden, norm, eps);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(-1);
  shape.push_back(head_dim);
  const at::Tensor qkv = Linear{kind, q, d, m}(x).view(shape).transpose(1, 2);
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
  if (o_kind == kInt8 && gate_up_kind == kInt8 &&
      down_kind == kInt8 && o_d.has_value() && gate_up_d.has_value() &&
      down_d.has_value() && int8_layer_fits(residual, 0, gate_up_q))
    return int8_attention_output(attention, residual, o_q, *o_d, norm, eps, gate_up_q,
                                 *gate_up_d, down_q, *down_d);
  if (passes_fit(residual, o_kind, 0, norm) && o_kind == gate_up_kind && o_kind == down_kind &&
      attention.scalar_type() == residual.scalar_type() && o_q.size(0) == residual.size(-1) &&
      down_q.size(0) == residual.size(-1) && gate_up_q.size(0) % (2 * kLanes) == 0) {
    return SEQGATE_DISPATCH_FLOAT_BF16(residual.scalar_type(), "lean_attention_output", [&] {
      return block_output<scalar_t>(attention, residual, {o_kind, o_q, o_d, o_m}, norm, eps,
                                    {gate_up_kind, gate_up_q, gate_up_d, gate_up_m},
                                    {down_kind, down_q, down_d, down_m});
    });
  }
  std::vector<int64_t> shape(residual.sizes().begin(), residual.sizes().end() - 1);
  shape.push_back(-1);
  const at::Tensor out = attention.reshape(shape).contiguous();
  const at::Tensor hidden = residual + Linear{o_kind, o_q, o_d, o_m}(out);
  const at::Tensor x = rms_norm(hidden, norm, eps);
  const std::vector<at::Tensor> gate_up =
      Linear{gate_up_kind, gate_up_q, gate_up_d, gate_up_m}(x).chunk(2, -1);
  return hidden + Linear{down_kind, down_q, down_d, down_m}(at::silu(gate_up[0]) * gate_up[1]);
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
