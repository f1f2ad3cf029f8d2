// A linear layer in int8 arithmetic for forwards of many rows (engine/model/w8a8.py): each row
// quantised to int8 with a scale of its own, the product summed in int32 (by oneDNN through
// ATen's `_int_mm` where that is exact, else by `widened_mm` below), and the sums scaled back
// per row and per output channel.
//
// The product is where the time goes, but done as separate ATen operators the quantising and
// scaling passes cost more than int8 saves over bf16 (six operators over the activations and
// three over the int32 sums). Here each is one vectorised pass over its rows.

#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randint.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "lowbit_linear.h"
#include "vec.h"

namespace {

using seqgate::kLanes;
using seqgate::load;
using seqgate::rotate_head;
using seqgate::round_to;
using seqgate::silu;
using seqgate::store;
using seqgate::Vec;

// v's lanes (each within int8's range) stored as int8 at q.
inline void store_int8(int8_t* q, const at::vec::Vectorized<int32_t>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(v));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i ints = v;
  const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(ints),
                                         _mm256_extracti128_si256(ints, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(halves, halves));
#else
  int32_t ints[kLanes];
  v.store(ints);
  for (int i = 0; i < kLanes; ++i) q[i] = static_cast<int8_t>(ints[i]);
#endif
}

inline float lanes_max(const Vec& v) {
  float lanes[kLanes];
  v.store(lanes);
  return *std::max_element(lanes, lanes + kLanes);
}

// row [cols] quantised into out with the scale of its largest magnitude `amax`; returns the
// scale.
template <typename T>
float quantise_row(const T* row, int64_t cols, float amax, int8_t* out) {
  // An all-zero row quantises to zeros with any scale; 1 keeps the inverse finite.
  const float inverse = 127.f / (amax > 0.f ? amax : 127.f);
  const Vec inv(inverse);
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes)
    // round(): to nearest even, as std::nearbyint in the default rounding mode.
    store_int8(out + c, at::vec::convert_to_int_of_same_size((load(row + c) * inv).round()));
  for (; c < cols; ++c)
    out[c] = static_cast<int8_t>(std::nearbyint(static_cast<float>(row[c]) * inverse));
  return amax > 0.f ? amax / 127.f : 1.f;
}

template <typename T>
void quantise_rows(const T* x, int64_t rows, int64_t cols, int8_t* q, float* scales) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * cols;
      int64_t c = 0;
      Vec top(0.f);
      for (; c + kLanes <= cols; c += kLanes) top = at::vec::maximum(top, load(row + c).abs());
      float amax = lanes_max(top);
      for (; c < cols; ++c) amax = std::max(amax, std::fabs(static_cast<float>(row[c])));
      scales[r] = quantise_row(row, cols, amax, q + r * cols);
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

// The int8 weights [in, out] and their scales as the products and passes read them, or an error.
void check_int8_layer(const at::Tensor& weight, const at::Tensor& scales, int64_t in,
                      int64_t out) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.size(0) == in &&
                  (out < 0 || weight.size(1) == out),
              "int8 layer: int8 weights [", in, ", ", out, "] expected, got ", weight.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == weight.size(1),
              "int8 layer: one fp32 scale per output channel expected");
}

// -- int32 sums of int8 products where oneDNN's would saturate ------------------------------------
//
// Without an instruction that sums int8 products into int32 (AVX512-VNNI, AVX-VNNI, AMX), oneDNN
// sums pairs of u8 × s8 products in int16 (vpmaddubsw), which saturates on 8-bit weights. This
// product widens both sides to int16 and sums each pair of products into an int32 (vpmaddwd,
// then vpaddd to accumulate): exact, at 16 multiply-adds per two instructions, as fp32's FMA
// does per one, but with the weights read as int8.

// Whether ATen's `_int_mm` sums int8 products exactly in int32 here, tried once on values at
// ±127: a kernel that sums pairs of u8 × s8 products in int16 (oneDNN without VNNI or AMX, or
// capped below them by ONEDNN_MAX_CPU_ISA) saturates there. tests/engine/test_w8a8.py makes
// the same test from Python to check this one.
bool int_mm_exact() {
  static const bool exact = [] {
    at::Tensor a = at::full({8, 64}, 127, at::TensorOptions().dtype(at::kChar));
    a.slice(0, 1, 8, 2).fill_(-127);
    at::Tensor b = at::full({64, 16}, 127, at::TensorOptions().dtype(at::kChar));
    b.slice(1, 1, 16, 2).fill_(-127);
    const at::Tensor want = at::matmul(a.to(at::kDouble), b.to(at::kDouble)).to(at::kInt);
    try {
      return at::equal(at::_int_mm(a, b), want);
    } catch (const std::exception&) {
      return false;  // no int8 product in this ATen build for the CPU
    }
  }();
  return exact;
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr int kBlockRows = 6;      // 12 accumulators, two weight vectors and a broadcast
constexpr int64_t kPanel = 16;     // output columns per panel: two vectors of 8 int32

// c[rows, cols of the panel] = a (int16, pairs of elements) times the panel (per pair of inputs:
// 16 columns × 2 int16, the first 8 columns' pairs then the last 8's).
template <int R>
void panel_block(const int16_t* a, int64_t lda, const __m256i* panel, int64_t pairs, int32_t* c,
                 int64_t ldc, int64_t cols) {
  __m256i acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i b0 = _mm256_load_si256(panel + 2 * p);
    const __m256i b1 = _mm256_load_si256(panel + 2 * p + 1);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof(pair));
      const __m256i av = _mm256_set1_epi32(pair);
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(av, b0));
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(av, b1));
    }
  }
  for (int i = 0; i < R; ++i) {
    if (cols == kPanel) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc), acc[i][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc + 8), acc[i][1]);
    } else {
      alignas(32) int32_t tail[kPanel];
      _mm256_store_si256(reinterpret_cast<__m256i*>(tail), acc[i][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(tail + 8), acc[i][1]);
      std::memcpy(c + i * ldc, tail, cols * sizeof(int32_t));
    }
  }
}

// The panel of columns [n0, n0 + cols) of `w` [in, out] widened to int16 pairs (inputs 2p and
// 2p + 1 side by side per column; a missing last input and missing columns are zeros).
void widen_panel(const int8_t* w, int64_t in, int64_t out, int64_t n0, int64_t cols,
                 __m256i* panel) {
  alignas(16) int8_t row0[kPanel], row1[kPanel];
  for (int64_t p = 0; 2 * p < in; ++p) {
    const int8_t* r0 = w + 2 * p * out + n0;
    const int8_t* r1 = 2 * p + 1 < in ? r0 + out : nullptr;
    __m128i x0, x1;
    if (cols == kPanel) {
      x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0));
      x1 = r1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1)) : _mm_setzero_si128();
    } else {
      std::memset(row0, 0, kPanel);
      std::memset(row1, 0, kPanel);
      std::memcpy(row0, r0, cols);
      if (r1) std::memcpy(row1, r1, cols);
      x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(row0));
      x1 = _mm_load_si128(reinterpret_cast<const __m128i*>(row1));
    }
    panel[2 * p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x0, x1));
    panel[2 * p + 1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x0, x1));
  }
}

// a [rows, in] times w [in, out], int8, summed exactly in int32.
at::Tensor widened_mm(const at::Tensor& a, const at::Tensor& w) {
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2 && a.size(1) == w.size(0) &&
                  a.scalar_type() == at::kChar && w.scalar_type() == at::kChar,
              "int8 product: int8 [rows, in] times int8 [in, out] expected");
  const int64_t rows = a.size(0), in = a.size(1), out = w.size(1);
  const int64_t pairs = (in + 1) / 2, lda = 2 * pairs;
  const at::Tensor ac = a.contiguous(), wc = w.contiguous();
  at::Tensor sums = at::empty({rows, out}, a.options().dtype(at::kInt));
  std::vector<int16_t> a16(rows * lda, 0);
  const int8_t* ap = ac.const_data_ptr<int8_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < in; ++i) a16[r * lda + i] = ap[r * in + i];
  const int8_t* wp = wc.const_data_ptr<int8_t>();
  int32_t* cp = sums.data_ptr<int32_t>();
  const int64_t panels = (out + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m256i> panel(2 * pairs);  // 32-byte aligned: C++17's aligned new
    for (int64_t j = begin; j < end; ++j) {
      const int64_t n0 = j * kPanel, cols = std::min(kPanel, out - n0);
      widen_panel(wp, in, out, n0, cols, panel.data());
      for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
        const int16_t* arow = a16.data() + r0 * lda;
        int32_t* crow = cp + r0 * out + n0;
        switch (std::min<int64_t>(kBlockRows, rows - r0)) {
          case 6: panel_block<6>(arow, lda, panel.data(), pairs, crow, out, cols); break;
          case 5: panel_block<5>(arow, lda, panel.data(), pairs, crow, out, cols); break;
          case 4: panel_block<4>(arow, lda, panel.data(), pairs, crow, out, cols); break;
          case 3: panel_block<3>(arow, lda, panel.data(), pairs, crow, out, cols); break;
          case 2: panel_block<2>(arow, lda, panel.data(), pairs, crow, out, cols); break;
          default: panel_block<1>(arow, lda, panel.data(), pairs, crow, out, cols); break;
        }
      }
    }
  });
  return sums;
}
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// The best of three calls' seconds, after one.
template <typename F>
double best_seconds(F&& f) {
  f();
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                              .count());
  }
  return best;
}

// Whether int8_mm takes ATen's product, decided once: where it sums exactly and is the faster
// of the two on a layer-sized product (32 rows × 576 × 576). Exact is not enough: on an
// AVX2-only AMD EPYC (Zen 3) oneDNN's is exact but a reference loop, about 3 GOPS against the
// widened product's 250. SEQGATE_INT8_PRODUCT=int16 takes the widened one wherever it is built.
bool aten_product_chosen() {
  static const bool chosen = [] {
    const char* forced = std::getenv("SEQGATE_INT8_PRODUCT");
    if ((forced != nullptr && std::string(forced) == "int16") || !int_mm_exact()) return false;
    const at::Tensor a = at::randint(-127, 128, {32, 576}, at::TensorOptions().dtype(at::kChar));
    const at::Tensor w = at::randint(-127, 128, {576, 576}, at::TensorOptions().dtype(at::kChar));
    return best_seconds([&] { at::_int_mm(a, w); }) <= best_seconds([&] { widened_mm(a, w); });
  }();
  return chosen;
}
#endif

// a [rows, in] times w [in, out], int8, summed in int32: oneDNN's where it sums exactly and is
// the faster, else the widened product.
at::Tensor int8_mm(const at::Tensor& a, const at::Tensor& w) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if (!aten_product_chosen()) return widened_mm(a, w);
#endif
  return at::_int_mm(a, w);
}

// Which product int8_mm takes here: "onednn" (ATen's `_int_mm`, exact and faster, on x86 with
// VNNI or AMX), "int16" (the widened one, on other x86 CPUs), "aten" (`_int_mm`, exact,
// elsewhere), or "none" (`_int_mm` inexact and nothing in its place: the engine does not use
// this library's product).
std::string int8_product_kind() {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return aten_product_chosen() ? "onednn" : "int16";
#else
  return int_mm_exact() ? "aten" : "none";
#endif
}

// x [rows, in] (fp32 or bf16, contiguous) times `weight` [in, out] (int8, each output channel
// scaled by `scales` [out], fp32), plus `bias` [out] in x's dtype; the result in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x [rows, in] expected");
  check_int8_layer(weight, scales, x.size(1), -1);
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
  SEQGATE_DISPATCH_FLOAT_BF16(rows.scalar_type(), "int8_linear", [&] {
    quantise_rows(rows.const_data_ptr<scalar_t>(), m, k, q.data_ptr<int8_t>(),
                  row_scales.data_ptr<float>());
    const at::Tensor sums = int8_mm(q, weight);
    scale_back(sums.const_data_ptr<int32_t>(), m, n, row_scales.const_data_ptr<float>(),
               scales.const_data_ptr<float>(), b ? b->const_data_ptr<scalar_t>() : nullptr,
               out.data_ptr<scalar_t>());
  });
  return out;
}

// -- A Llama layer's work around its attention, in int8 arithmetic, in few passes ----------------
//
// Done as ATen operators, the work between a layer's four int8 products (the norms, rotary
// embedding, SiLU, residuals, and the quantising and scaling passes) took a third of the layer's
// time at 64 rows, about as much as the products of one layer's MLP. Here it is a few passes
// over each row's values while they are in the cache. The roundings to the model's dtype are
// where the model's forward rounds, but the norms' sums of squares are added in another order
// than ATen's: results are close to the operator-by-operator forward, not equal to it bit for
// bit (w8a8 is an approximation, judged by its distance from fp32: docs/benchmarks/speed.md).

inline float lanes_sum(const Vec& v) {
  float lanes[kLanes];
  v.store(lanes);
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += lanes[i];
  return s;
}

// LlamaRMSNorm of the row h [cols] with weight w, into x (floats holding T values), quantised
// into q; returns the row's scale.
template <typename T>
float norm_quantise_row(const T* h, const T* w, int64_t cols, float eps, float* x, int8_t* q) {
  Vec squares(0.f);
  for (int64_t c = 0; c < cols; c += kLanes) {
    const Vec v = load(h + c);
    squares = squares + v * v;
  }
  const Vec inv(1.f / std::sqrt(lanes_sum(squares) / static_cast<float>(cols) + eps));
  Vec top(0.f);
  for (int64_t c = 0; c < cols; c += kLanes) {
    const Vec v = round_to<T>(load(w + c) * round_to<T>(load(h + c) * inv));
    v.store(x + c);
    top = at::vec::maximum(top, v.abs());
  }
  return quantise_row(x, cols, lanes_max(top), q);
}

// The int32 sums of a row times its scale and each column's, rounded to T (scale_back's
// arithmetic), into x.
template <typename T>
inline void scale_row(const int32_t* sums, float row_scale, const float* col_scales, int64_t cols,
                      float* x) {
  const Vec rs(row_scale);
  for (int64_t c = 0; c < cols; c += kLanes)
    round_to<T>(at::vec::convert_to_fp_of_same_size<float>(
                    at::vec::Vectorized<int32_t>::loadu(sums + c)) * rs * Vec::loadu(col_scales + c))
        .store(x + c);
}

// A residual row plus a product's row of int32 sums scaled back (rounded to T, then the sum
// rounded to T: the model's `residual + linear(x)`), into out; x is scratch of cols floats.
template <typename T>
inline void add_scaled_row(const int32_t* sums, float row_scale, const float* col_scales,
                           int64_t cols, const T* residual, float* x, T* out) {
  scale_row<T>(sums, row_scale, col_scales, cols, x);
  for (int64_t c = 0; c < cols; c += kLanes)
    store(out + c, load(residual + c) + Vec::loadu(x + c));
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_inputs(
    const at::Tensor& hidden, const at::Tensor& norm, double eps, const at::Tensor& weight,
    const at::Tensor& scales, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
    const at::Tensor& cos, const at::Tensor& signed_sin) {
  const int64_t batch = hidden.size(0), tokens = hidden.size(1), cols = hidden.size(2);
  const int64_t m = batch * tokens, n = weight.size(1), turned = (q_heads + kv_heads) * head_dim;
  const at::Tensor h = hidden.contiguous(), w = norm.contiguous();
  at::Tensor q = at::empty({m, cols}, h.options().dtype(at::kChar));
  at::Tensor row_scales = at::empty({m}, h.options().dtype(at::kFloat));
  const T* hp = h.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* rsp = row_scales.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(cols);
    for (int64_t r = begin; r < end; ++r)
      rsp[r] = norm_quantise_row(hp + r * cols, wp, cols, static_cast<float>(eps), x.data(),
                                 qp + r * cols);
  });
  const at::Tensor sums = int8_mm(q, weight);
  at::Tensor out = at::empty({m, n}, h.options());
  // [batch, tokens, head_dim] views of the tables ([rows or 1, 1, tokens, head_dim]), which
  // broadcast over the batch.
  const at::Tensor cs = cos.to(h.scalar_type()).contiguous().expand(
      {batch, 1, tokens, head_dim}).select(1, 0);
  const at::Tensor sn = signed_sin.to(h.scalar_type()).contiguous().expand(
      {batch, 1, tokens, head_dim}).select(1, 0);
  const T* cp = cs.const_data_ptr<T>();
  const T* snp = sn.const_data_ptr<T>();
  const int32_t* sp = sums.const_data_ptr<int32_t>();
  const float* col = scales.const_data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t half = head_dim / 2;
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> x(n);
    for (int64_t r = begin; r < end; ++r) {
      scale_row<T>(sp + r * n, rsp[r], col, n, x.data());
      const int64_t b = r / tokens, t = r % tokens;
      const T* c_row = cp + b * cs.stride(0) + t * cs.stride(1);
      const T* s_row = snp + b * sn.stride(0) + t * sn.stride(1);
      T* o = op + r * n;
      // Query and key heads turned; value heads as they are.
      for (int64_t head = 0; head < turned; head += head_dim)
        rotate_head(x.data() + head, o + head, c_row, s_row, half);
      for (int64_t c = turned; c < n; c += kLanes) store(o + c, Vec::loadu(x.data() + c));
    }
  });
  const at::Tensor heads = out.view({batch, tokens, -1, head_dim}).transpose(1, 2);
  return {heads.slice(1, 0, q_heads), heads.slice(1, q_heads, q_heads + kv_heads),
          heads.slice(1, q_heads + kv_heads)};
}

template <typename T>
at::Tensor attention_output(const at::Tensor& attention, const at::Tensor& residual,
                            const at::Tensor& o_weight, const at::Tensor& o_scales,
                            const at::Tensor& norm, double eps, const at::Tensor& gate_up_weight,
                            const at::Tensor& gate_up_scales, const at::Tensor& down_weight,
                            const at::Tensor& down_scales) {
  const int64_t cols = residual.size(-1), m = residual.numel() / cols;
  const int64_t inner = gate_up_weight.size(1) / 2;
  const at::Tensor a = attention.reshape({m, -1}).contiguous();
  const at::Tensor res = residual.contiguous(), w = norm.contiguous();
  const auto options = res.options();
  at::Tensor q = at::empty({m, a.size(1)}, options.dtype(at::kChar));
  at::Tensor row_scales = at::empty({m}, options.dtype(at::kFloat));
  quantise_rows(a.const_data_ptr<T>(), m, a.size(1), q.data_ptr<int8_t>(),
                row_scales.data_ptr<float>());
  const at::Tensor o_sums = int8_mm(q, o_weight);
  // The residual plus the output projection, kept for the layer's last residual; then the
  // post-attention norm, quantised.
  at::Tensor hidden = at::empty({m, cols}, options);
  at::Tensor q_mid = at::empty({m, cols}, options.dtype(at::kChar));
  at::Tensor mid_scales = at::empty({m}, options.dtype(at::kFloat));
  {
    const int32_t* sp = o_sums.const_data_ptr<int32_t>();
    const float* rsp = row_scales.const_data_ptr<float>();
    const float* col = o_scales.const_data_ptr<float>();
    const T* rp = res.const_data_ptr<T>();
    const T* wp = w.const_data_ptr<T>();
    T* hp = hidden.data_ptr<T>();
    int8_t* qp = q_mid.data_ptr<int8_t>();
    float* msp = mid_scales.data_ptr<float>();
    at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> x(cols);
      for (int64_t r = begin; r < end; ++r) {
        add_scaled_row<T>(sp + r * cols, rsp[r], col, cols, rp + r * cols, x.data(),
                          hp + r * cols);
        msp[r] = norm_quantise_row(hp + r * cols, wp, cols, static_cast<float>(eps), x.data(),
                                   qp + r * cols);
      }
    });
  }
  const at::Tensor gate_up = int8_mm(q_mid, gate_up_weight);
  // SiLU(gate) * up, each rounded to T (F.silu, then the product), quantised for the down
  // projection.
  at::Tensor q_act = at::empty({m, inner}, options.dtype(at::kChar));
  at::Tensor act_scales = at::empty({m}, options.dtype(at::kFloat));
  {
    const int32_t* sp = gate_up.const_data_ptr<int32_t>();
    const float* rsp = mid_scales.const_data_ptr<float>();
    const float* col = gate_up_scales.const_data_ptr<float>();
    int8_t* qp = q_act.data_ptr<int8_t>();
    float* asp = act_scales.data_ptr<float>();
    at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> x(2 * inner);
      for (int64_t r = begin; r < end; ++r) {
        scale_row<T>(sp + r * 2 * inner, rsp[r], col, 2 * inner, x.data());
        Vec top(0.f);
        for (int64_t c = 0; c < inner; c += kLanes) {
          const Vec v = round_to<T>(round_to<T>(silu(Vec::loadu(x.data() + c))) *
                                    Vec::loadu(x.data() + inner + c));
          v.store(x.data() + c);
          top = at::vec::maximum(top, v.abs());
        }
        asp[r] = quantise_row(x.data(), inner, lanes_max(top), qp + r * inner);
      }
    });
  }
  const at::Tensor down = int8_mm(q_act, down_weight);
  at::Tensor out = at::empty({m, cols}, options);
  {
    const int32_t* sp = down.const_data_ptr<int32_t>();
    const float* asp = act_scales.const_data_ptr<float>();
    const float* col = down_scales.const_data_ptr<float>();
    const T* hp = hidden.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> x(cols);
      for (int64_t r = begin; r < end; ++r)
        add_scaled_row<T>(sp + r * cols, asp[r], col, cols, hp + r * cols, x.data(),
                          op + r * cols);
    });
  }
  return out.view(residual.sizes());
}

void check_norm(const at::Tensor& norm, const at::Tensor& hidden) {
  TORCH_CHECK(norm.numel() == hidden.size(-1) && norm.scalar_type() == hidden.scalar_type(),
              "int8 layer: a norm weight of the hidden size and dtype expected");
}

}  // namespace

namespace seqgate {

bool int8_layer_fits(const at::Tensor& hidden, int64_t head_dim, const at::Tensor& weight) {
  return hidden.dim() == 3 && (hidden.scalar_type() == at::kFloat ||
                               hidden.scalar_type() == at::kBFloat16) &&
         hidden.size(-1) % kLanes == 0 && head_dim % (2 * kLanes) == 0 &&
         weight.size(1) % (2 * kLanes) == 0;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_attention_inputs(
    const at::Tensor& hidden, const at::Tensor& norm, double eps, const at::Tensor& weight,
    const at::Tensor& scales, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
    const at::Tensor& cos, const at::Tensor& signed_sin) {
  check_norm(norm, hidden);
  check_int8_layer(weight, scales, hidden.size(-1), -1);
  TORCH_CHECK(weight.size(1) >= (q_heads + kv_heads) * head_dim,
              "int8 attention inputs: a weight for the query, key and value heads expected");
  return SEQGATE_DISPATCH_FLOAT_BF16(hidden.scalar_type(), "int8_attention_inputs", [&] {
    return attention_inputs<scalar_t>(hidden, norm, eps, weight, scales, q_heads, kv_heads,
                                      head_dim, cos, signed_sin);
  });
}

at::Tensor int8_attention_output(const at::Tensor& attention, const at::Tensor& residual,
                                 const at::Tensor& o_weight, const at::Tensor& o_scales,
                                 const at::Tensor& norm, double eps,
                                 const at::Tensor& gate_up_weight,
                                 const at::Tensor& gate_up_scales, const at::Tensor& down_weight,
                                 const at::Tensor& down_scales) {
  const int64_t cols = residual.size(-1);
  check_norm(norm, residual);
  TORCH_CHECK(attention.numel() % (residual.numel() / cols) == 0 &&
                  attention.scalar_type() == residual.scalar_type(),
              "int8 attention output: the attention's rows in the residual's dtype expected");
  check_int8_layer(o_weight, o_scales, attention.numel() / (residual.numel() / cols), cols);
  check_int8_layer(gate_up_weight, gate_up_scales, cols, -1);
  check_int8_layer(down_weight, down_scales, gate_up_weight.size(1) / 2, cols);
  return SEQGATE_DISPATCH_FLOAT_BF16(residual.scalar_type(), "int8_attention_output", [&] {
    return attention_output<scalar_t>(attention, residual, o_weight, o_scales, norm, eps,
                                      gate_up_weight, gate_up_scales, down_weight, down_scales);
  });
}

at::Tensor int8_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& bias) {
  return int8_linear(x, weight, scales, bias);
}

}  // namespace seqgate

TORCH_LIBRARY_FRAGMENT(seqgate, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int8_product_kind() -> str", &int8_product_kind);
  m.def("int8_sums_exact() -> bool", &int_mm_exact);
}

TORCH_LIBRARY_IMPL(seqgate, CPU, m) { m.impl("int8_linear", &int8_linear); }
