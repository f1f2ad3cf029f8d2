// A linear layer in int8 arithmetic for forwards of many rows (engine/model/w8a8.py): each row
// quantised to int8 with a scale of its own, the product summed in int32 by oneDNN (ATen's
// `_int_mm`), and the sums scaled back per row and per output channel.
//
// The product is where the time goes, but done as separate ATen operators the quantising and
// scaling passes cost more than int8 saves over bf16 (six operators over the activations and
// three over the int32 sums). Here each is one vectorised pass over its rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "lowbit_linear.h"
#include "vec.h"

namespace {

using seqgate::kLanes;
using seqgate::load;
using seqgate::Vec;

inline void store(float* p, const Vec& v) { v.store(p); }
inline void store(at::BFloat16* p, const Vec& v) {
  // Rounded to nearest even, as a .to(torch.bfloat16) does; only the first kLanes are stored.
  at::vec::convert_from_float<at::BFloat16>(v, v).store(p, kLanes);
}

template <typename T>
void quantise_rows(const T* x, int64_t rows, int64_t cols, int8_t* q, float* scales) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    int32_t ints[kLanes];
    float lanes[kLanes];
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * cols;
      int64_t c = 0;
      Vec top(0.f);
      for (; c + kLanes <= cols; c += kLanes) top = at::vec::maximum(top, load(row + c).abs());
      top.store(lanes);
      float amax = *std::max_element(lanes, lanes + kLanes);
      for (; c < cols; ++c) amax = std::max(amax, std::fabs(static_cast<float>(row[c])));
      // An all-zero row quantises to zeros with any scale; 1 keeps the inverse finite.
      const float scale = amax > 0.f ? amax / 127.f : 1.f;
      const float inverse = 127.f / (amax > 0.f ? amax : 127.f);
      int8_t* out = q + r * cols;
      const Vec inv(inverse);
      for (c = 0; c + kLanes <= cols; c += kLanes) {
        // round(): to nearest even, as std::nearbyint in the default rounding mode.
        at::vec::convert_to_int_of_same_size((load(row + c) * inv).round()).store(ints);
        for (int i = 0; i < kLanes; ++i) out[c + i] = static_cast<int8_t>(ints[i]);
      }
      for (; c < cols; ++c)
        out[c] = static_cast<int8_t>(std::nearbyint(static_cast<float>(row[c]) * inverse));
      scales[r] = scale;
    }
  });
}

template <typename T>
void scale_back(const int32_t* sums, int64_t rows, int64_t cols, const float* row_scales,
                const float* col_scales, const T* bias, T* out) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* in = sums + r * cols;
      T* o = out + r * cols;
      const float rs = row_scales[r];
      const Vec vrs(rs);
      int64_t c = 0;
      for (; c + kLanes <= cols; c += kLanes) {
        Vec v = at::vec::convert_to_fp_of_same_size<float>(
                    at::vec::Vectorized<int32_t>::loadu(in + c)) * vrs * Vec::loadu(col_scales + c);
        if (bias != nullptr) v = v + load(bias + c);
        store(o + c, v);
      }
      for (; c < cols; ++c) {
        float v = static_cast<float>(in[c]) * rs * col_scales[c];
        if (bias != nullptr) v += static_cast<float>(bias[c]);
        o[c] = static_cast<T>(v);
      }
    }
  });
}

// x [rows, in] (fp32 or bf16, contiguous) times `weight` [in, out] (int8, each output channel
// scaled by `scales` [out], fp32), plus `bias` [out] in x's dtype; the result in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(0),
              "int8_linear: x [rows, in] and weight [in, out] expected");
  TORCH_CHECK(weight.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat &&
                  scales.numel() == weight.size(1) && scales.is_contiguous(),
              "int8_linear: int8 weights and one fp32 scale per output channel expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_linear: fp32 or bf16 rows expected");
  const at::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), n = weight.size(1);
  at::Tensor q = at::empty({m, k}, rows.options().dtype(at::kChar));
  at::Tensor row_scales = at::empty({m}, rows.options().dtype(at::kFloat));
  at::Tensor out = at::empty({m, n}, rows.options());
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "int8_linear: one bias per output channel expected");
    b = bias->to(rows.scalar_type()).contiguous();
  }
  auto run = [&](auto* rows_of_type) {
    using T = std::remove_pointer_t<decltype(rows_of_type)>;
    quantise_rows(rows.const_data_ptr<T>(), m, k, q.data_ptr<int8_t>(),
                  row_scales.data_ptr<float>());
    const at::Tensor sums = at::_int_mm(q, weight);
    scale_back(sums.const_data_ptr<int32_t>(), m, n, row_scales.const_data_ptr<float>(),
               scales.const_data_ptr<float>(), b ? b->const_data_ptr<T>() : nullptr,
               out.data_ptr<T>());
  };
  if (rows.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<at::BFloat16*>(nullptr));
  return out;
}

}  // namespace

namespace seqgate {

at::Tensor int8_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& bias) {
  return int8_linear(x, weight, scales, bias);
}

}  // namespace seqgate

TORCH_LIBRARY_FRAGMENT(seqgate, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(seqgate, CPU, m) { m.impl("int8_linear", &int8_linear); }
