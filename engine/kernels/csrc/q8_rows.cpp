// Linear layers over Q4_1 and Q8_0 blocks with the input rows rounded to 8 bits, for forwards of
// a few rows on the CPU: llama.cpp's own arithmetic, for the rounded formats
// (`--quantize int4` / `int8`, engine.model.lowbit).
//
// The exact block kernel (lowbit_linear.cpp) rebuilds every weight in fp32 and multiplies it with
// an FMA: on an AVX2 CPU that is about 30 instructions per block of 32 weights at one row, and
// a one-row step is bound by them, not by the bytes (docs/benchmarks/speed.md). Here each row is
// rounded, per block of 32 input columns, to int8 with its own scale (llama.cpp's Q8_1:
// dx = max|x| / 127, qx = round(x * (1 / dx)), sx = dx * sum(qx)), and a block's dot product is
// summed in integers: 32 products of an unsigned byte and a signed one in one `vpmaddubsw`,
// pairs of those in int32 with `vpmaddwd`, then scaled once in fp32:
//   Q4_1 (w = q * d + m): sum(w * x) ≈ d * dx * sum(q * qx) + m * sx
//   Q8_0 (w = q * d):     sum(w * x) ≈ d * dx * sum(q * qx)
// The integer sums are exact; the approximation is the rounding of the rows, which is why these
// serve only formats that were rounded already and are judged, as they are, by their next-token
// distance from fp32 (bench/studies/quality.py). Each row's result depends on that row alone
// (its own scales, the same order of additions whatever the rows beside it); a sequence's
// tokens still can, where a forward's row count takes it past the kernel's limit (then the
// fp32 product) or a verified draft's attention sums in another order.
//
// Registered as torch.ops.seqgate.q4_q8_linear / q8_q8_linear; the intrinsics are AVX2 (also
// built into the AVX512 library), other CPUs run the same arithmetic in a scalar loop. Checked in
// tests/engine/test_lowbit.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define SEQGATE_Q8_ROWS_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lowbit_linear.h"

namespace {

constexpr int kBlock = 32;       // input columns per block
constexpr int kMaxRows = 8;      // input rows one pass over the weights serves
constexpr int64_t kTile = 32;    // output rows whose weights one pass keeps cached

// The rows rounded to 8 bits, block by block: q [rows, in] int8, d and s [rows, blocks] fp32.
struct Rows {
  at::Tensor q, d, s;
};

// Rounds x's rows ([rows, in] fp32, contiguous) as llama.cpp's quantize_row_q8_1 does, scales in
// fp32: q = round-half-even(x / d), d = max|x| / 127 (0 for an all-zero block), s = d * sum(q).
Rows round_rows(const at::Tensor& x) {
  const int64_t n = x.size(0), in = x.size(1), blocks = in / kBlock;
  Rows r{at::empty({n, in}, x.options().dtype(at::kChar)),
         at::empty({n, blocks}, x.options()), at::empty({n, blocks}, x.options())};
  const float* xp = x.const_data_ptr<float>();
  int8_t* qp = r.q.data_ptr<int8_t>();
  float* dp = r.d.data_ptr<float>();
  float* sp = r.s.data_ptr<float>();
  for (int64_t b = 0; b < n * blocks; ++b) {
    const float* v = xp + b * kBlock;
    int8_t* q = qp + b * kBlock;
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
#if defined(SEQGATE_Q8_ROWS_AVX2)
    const __m256 scale = _mm256_set1_ps(id);
    __m256i i[4];
    for (int k = 0; k < 4; ++k)  // rounds to nearest even, as std::nearbyint below
      i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * k), scale));
    const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]),
                                          _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    sum = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
    // int32 -> int16 -> int8 packs within 128-bit lanes; the permute restores column order.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                              _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(packed,
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int j = 0; j < kBlock; ++j) {
      q[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
      sum += q[j];
    }
#endif
    dp[b] = d;
    sp[b] = d * static_cast<float>(sum);
  }
  return r;
}

struct Weights {
  const uint8_t* q;     // [out, row_bytes]: Q4_1's packed nibbles or Q8_0's int8
  const at::Half* d;    // [out, blocks]
  const at::Half* m;    // [out, blocks], Q4_1 only
  int64_t blocks, row_bytes;
};

struct RowsView {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t in, blocks;
};

inline float half(const at::Half& h) { return static_cast<float>(h); }

#if defined(SEQGATE_Q8_ROWS_AVX2)
// A Q4_1 block's 32 q values as unsigned bytes, in column order (byte j: column j low nibble,
// column j + 16 high).
inline __m256i nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// The 8 int32 partial sums of 32 products of u (unsigned, at most 128) and s (signed, at most
// 127 in magnitude): pairs in int16 cannot saturate (2 * 128 * 127 < 32768).
inline __m256 dot(const __m256i u, const __m256i s) {
  return _mm256_cvtepi32_ps(
      _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

inline float sum_lanes(const __m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// The scales of output row o's blocks [b0, b0 + n) times each row's (scale[r * n + b] =
// d * dx), and sum(m * sx) over those blocks added to mins[r] (Q4_1).
template <bool Q4, int R>
inline void block_scales(const Weights& w, const RowsView& x, int64_t o, int64_t b0, int n,
                         float* scale, float* mins) {
  const at::Half* wd = w.d + o * w.blocks + b0;
  const at::Half* wm = Q4 ? w.m + o * w.blocks + b0 : nullptr;
  for (int r = 0; r < R; ++r) {
    const float* xd = x.d + r * x.blocks + b0;
    const float* xs = x.s + r * x.blocks + b0;
    int b = 0;
#if defined(SEQGATE_Q8_ROWS_AVX2)
    __m256 m8 = _mm256_setzero_ps();
    for (; b + 8 <= n; b += 8) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b)));
      _mm256_storeu_ps(scale + r * n + b, _mm256_mul_ps(d, _mm256_loadu_ps(xd + b)));
      if constexpr (Q4) {
        const __m256 m =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + b)));
        m8 = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + b), m8);
      }
    }
    if constexpr (Q4) mins[r] += sum_lanes(m8);
#endif
    for (; b < n; ++b) {
      scale[r * n + b] = half(wd[b]) * xd[b];
      if constexpr (Q4) mins[r] += half(wm[b]) * xs[b];
    }
  }
}

#if defined(SEQGATE_Q8_ROWS_AVX2)
using Acc = __m256;
#else
using Acc = float;
#endif

// Blocks b and b + 1 of one output row (its weights at wq) times R rows: acc[r] +=
// scale0 * dot0 + scale1 * dot1, each row's scales at scale[r * stride] (and the next);
// `pair` false: block b alone. One sum a row, whose chain waits on an addition every two
// blocks; the order is the same whatever R is.
template <bool Q4, int R>
inline void blocks(const uint8_t* wq, const RowsView& x, int64_t b, const float* scale,
                   int stride, bool pair, Acc* acc) {
#if defined(SEQGATE_Q8_ROWS_AVX2)
  __m256i u[2];  // the weights as unsigned bytes (Q8_0: their magnitudes)
  __m256i signs[2];
  const int count = pair ? 2 : 1;
  for (int k = 0; k < count; ++k) {
    if constexpr (Q4) {
      u[k] = nibbles(wq + (b + k) * (kBlock / 2));
    } else {
      signs[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (b + k) * kBlock));
      u[k] = _mm256_sign_epi8(signs[k], signs[k]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* row = x.q + r * x.in + b * kBlock;
    __m256i s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    if constexpr (!Q4) s0 = _mm256_sign_epi8(s0, signs[0]);  // the weights' signs moved over
    __m256 t = _mm256_mul_ps(_mm256_broadcast_ss(scale + r * stride), dot(u[0], s0));
    if (pair) {
      __m256i s1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kBlock));
      if constexpr (!Q4) s1 = _mm256_sign_epi8(s1, signs[1]);
      t = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + r * stride + 1), dot(u[1], s1), t);
    }
    acc[r] = _mm256_add_ps(acc[r], t);
  }
#else
  for (int r = 0; r < R; ++r) {
    float t = 0.f;
    for (int k = 0; k < (pair ? 2 : 1); ++k) {
      const int8_t* s = x.q + r * x.in + (b + k) * kBlock;
      int32_t sum = 0;
      if constexpr (Q4) {
        const uint8_t* p = wq + (b + k) * (kBlock / 2);
        for (int j = 0; j < kBlock / 2; ++j)
          sum += (p[j] & 0x0F) * s[j] + (p[j] >> 4) * s[j + kBlock / 2];
      } else {
        const int8_t* p = reinterpret_cast<const int8_t*>(wq) + (b + k) * kBlock;
        for (int j = 0; j < kBlock; ++j) sum += p[j] * s[j];
      }
      t += scale[r * stride + k] * static_cast<float>(sum);
    }
    acc[r] += t;
  }
#endif
}

constexpr int kChunk = 64;  // blocks whose scales are worked out at a time (on the stack)

// y[r, o] for R rows and output rows [begin, end). Each row's sum runs in the same order
// whatever R is (`blocks`), so its result does not depend on the rows beside it.
template <bool Q4, int R>
void rows(const Weights& w, const RowsView& x, float* y, int64_t ldy, int64_t begin,
          int64_t end) {
  alignas(64) float scale[R * kChunk];
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* wq = w.q + o * w.row_bytes;
    float mins[R] = {};
    Acc acc[R];
#if defined(SEQGATE_Q8_ROWS_AVX2)
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#else
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
#endif
    for (int64_t b0 = 0; b0 < w.blocks; b0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, w.blocks - b0));
      block_scales<Q4, R>(w, x, o, b0, n, scale, mins);
      int i = 0;
      for (; i + 2 <= n; i += 2) blocks<Q4, R>(wq, x, b0 + i, scale + i, n, true, acc);
      if (i < n) blocks<Q4, R>(wq, x, b0 + i, scale + i, n, false, acc);
    }
    for (int r = 0; r < R; ++r) {
#if defined(SEQGATE_Q8_ROWS_AVX2)
      y[r * ldy + o] = sum_lanes(acc[r]) + mins[r];
#else
      y[r * ldy + o] = acc[r] + mins[r];
#endif
    }
  }
}

template <bool Q4>
void rows_any(int n, const Weights& w, const RowsView& x, float* y, int64_t ldy, int64_t begin,
              int64_t end) {
  switch (n) {
    case 1: return rows<Q4, 1>(w, x, y, ldy, begin, end);
    case 2: return rows<Q4, 2>(w, x, y, ldy, begin, end);
    case 3: return rows<Q4, 3>(w, x, y, ldy, begin, end);
    case 4: return rows<Q4, 4>(w, x, y, ldy, begin, end);
    case 5: return rows<Q4, 5>(w, x, y, ldy, begin, end);
    case 6: return rows<Q4, 6>(w, x, y, ldy, begin, end);
    case 7: return rows<Q4, 7>(w, x, y, ldy, begin, end);
    default: return rows<Q4, 8>(w, x, y, ldy, begin, end);
  }
}

void check(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, int64_t row_bytes) {
  TORCH_CHECK(x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2,
              "x: a CPU float32 or bfloat16 matrix");
  TORCH_CHECK(x.size(1) % kBlock == 0, "x: columns a multiple of 32");
  const int64_t blocks = x.size(1) / kBlock;
  TORCH_CHECK(q.is_contiguous() && q.dim() == 2 && q.size(1) == blocks * row_bytes,
              "weights: [out, ", blocks * row_bytes, "] contiguous");
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.dim() == 2 &&
                  d.size(0) == q.size(0) && d.size(1) == blocks,
              "scales: [out, ", blocks, "] float16 contiguous");
}

template <bool Q4>
at::Tensor linear(const at::Tensor& input, const Weights& w, int64_t out) {
  const at::Tensor x = input.to(at::kFloat).contiguous();
  const Rows rounded = round_rows(x);
  const int64_t n = x.size(0);
  const RowsView v{rounded.q.const_data_ptr<int8_t>(), rounded.d.const_data_ptr<float>(),
                   rounded.s.const_data_ptr<float>(), x.size(1), w.blocks};
  at::Tensor y = at::empty({n, out}, x.options());
  float* yp = y.data_ptr<float>();
  // Output rows split across threads; every thread sees all input rows, kMaxRows at a time,
  // over a tile of output rows whose weights stay in the core's cache between row groups.
  at::parallel_for(0, out, kTile, [&](int64_t begin, int64_t end) {
    for (int64_t o0 = begin; o0 < end; o0 += kTile)
      for (int64_t r0 = 0; r0 < n; r0 += kMaxRows) {
        const RowsView part{v.q + r0 * v.in, v.d + r0 * v.blocks, v.s + r0 * v.blocks, v.in,
                            v.blocks};
        rows_any<Q4>(static_cast<int>(std::min<int64_t>(kMaxRows, n - r0)), w, part,
                     yp + r0 * out, out, o0, std::min(o0 + kTile, end));
      }
  });
  return input.scalar_type() == at::kFloat ? y : y.to(input.scalar_type());
}

}  // namespace

namespace seqgate {

// x [rows, in] float32 or bfloat16 (the result alike); q [out, in / 2] uint8; d, m [out, in / 32]
// float16 -> [rows, out].
at::Tensor q4_q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                        const at::Tensor& m) {
  check(x, q, d, kBlock / 2);
  TORCH_CHECK(q.scalar_type() == at::kByte, "weights: uint8");
  TORCH_CHECK(m.is_contiguous() && m.scalar_type() == at::kHalf && m.sizes() == d.sizes(),
              "mins: shaped as the scales, float16 contiguous");
  const Weights w{q.const_data_ptr<uint8_t>(), d.const_data_ptr<at::Half>(),
                  m.const_data_ptr<at::Half>(), d.size(1), q.size(1)};
  return linear<true>(x, w, q.size(0));
}

// x [rows, in] float32 or bfloat16; q [out, in] int8; d [out, in / 32] float16 -> [rows, out].
at::Tensor q8_q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d) {
  check(x, q, d, kBlock);
  TORCH_CHECK(q.scalar_type() == at::kChar, "weights: int8");
  const Weights w{reinterpret_cast<const uint8_t*>(q.const_data_ptr<int8_t>()),
                  d.const_data_ptr<at::Half>(), nullptr, d.size(1), q.size(1)};
  return linear<false>(x, w, q.size(0));
}

}  // namespace seqgate

TORCH_LIBRARY_FRAGMENT(seqgate, m) {
  m.def("q4_q8_linear(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("q8_q8_linear(Tensor x, Tensor q, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(seqgate, CPU, m) {
  m.impl("q4_q8_linear", &seqgate::q4_q8_linear);
  m.impl("q8_q8_linear", &seqgate::q8_q8_linear);
}
