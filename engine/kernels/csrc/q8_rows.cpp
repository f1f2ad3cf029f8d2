// Linear layers over Q4_1 and Q8_0 blocks with the input rows rounded to 8 bits, for forwards of
// a few rows on the CPU: llama.cpp's own arithmetic, for the rounded formats
// (`--quantize int4` / `int8`, engine.model.lowbit).
//
// The exact block kernel (lowbit_linear.cpp) rebuilds every weight in fp32 and multiplies it with
// an FMA: on an AVX2 CPU that is about 30 instructions per block of 32 weights at one row, and
// a one-row step is bound by them, not by the bytes (docs/benchmarks/speed.md). Here each row is
// rounded, per block of 32 input columns, to int8 with its own scale (llama.cpp's Q8_1:
// dx = max|x| / 127, qx = round(x * (1 / dx)), sx = dx * sum(qx)), and a block's dot product is
// summed in integers (`vpmaddubsw`: products of an unsigned byte and a signed one, in pairs),
// then scaled once in fp32:
//   Q4_1 (w = q * d + m): sum(w * x) ≈ d * dx * sum(q * qx) + m * sx
//   Q8_0 (w = q * d):     sum(w * x) ≈ d * dx * sum(q * qx)
// The integer sums are exact; the approximation is the rounding of the rows, which is why these
// serve only formats that were rounded already and are judged, as they are, by their next-token
// distance from fp32 (bench/studies/quality.py). Each row's result depends on that row alone
// (its own scales, the same order of additions whatever the rows beside it); a sequence's
// tokens still can, where a forward's row count takes it past the kernel's limit (then the
// fp32 product) or a verified draft's attention sums in another order.
//
// Q4_1 comes in tiles of 8 output rows (engine.model.blocks.tile_q4, kind "q4x8"): per tile and
// block, 4 vectors of 32 bytes whose byte 4k + c holds output row k's column 4h + c (low nibble)
// and 16 + 4h + c (high nibble), and the 8 rows' scales and mins side by side. One `vpmaddubsw`
// then multiplies 4 columns of 8 output rows by a row's 4 columns broadcast, eight of them sum a
// block in int16 (at most 8 * 2 * 15 * 127 < 32768), and one conversion and one FMA scale the
// 8 outputs at once: about half the instructions per row and block of a layout with one output
// row per vector, which needs the same conversion and FMA for one output (docs/benchmarks/
// speed.md).
//
// Q8_0 comes in tiles of 8 output rows too (tile_q8, kind "q8x8"): per tile and block, 8 vectors
// whose byte 4k + c holds output row k's column 4g + c plus 128. The unsigned byte splits into
// two nibbles that `vpmaddubsw` takes as Q4_1's are taken, and sum(w * x) = 16 * sum(high * x) +
// sum(low * x) - 128 * sum(x) in integers: two multiplications per 32 products, where the
// per-row layout (`rows`, for layers whose rows do not make whole tiles) needs a sign
// instruction and a widening sum for each, plus its conversion and FMA per output
// (docs/benchmarks/speed.md).
//
// Registered as torch.ops.seqgate.q4x8_q8_linear / q8x8_q8_linear / q8_q8_linear; the intrinsics
// are AVX2 (also built into the AVX512 library), other CPUs run the same arithmetic in a scalar
// loop. Checked in tests/engine/test_lowbit.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define SEQGATE_Q8_ROWS_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "lowbit_linear.h"

namespace {

constexpr int kBlock = 32;       // input columns per block

// The rows rounded to 8 bits, block by block: q [rows, in] int8, d and s [rows, blocks] fp32,
// and each block's sum(q) in int32 (qs).
struct Rows {
  at::Tensor q, d, s, qs;
};

// Rounds x's rows ([rows, in] fp32, contiguous) as llama.cpp's quantize_row_q8_1 does, scales in
// fp32: q = round-half-even(x / d), d = max|x| / 127 (0 for an all-zero block), s = d * sum(q).
Rows round_rows(const at::Tensor& x) {
  const int64_t n = x.size(0), in = x.size(1), blocks = in / kBlock;
  Rows r{at::empty({n, in}, x.options().dtype(at::kChar)),
         at::empty({n, blocks}, x.options()), at::empty({n, blocks}, x.options()),
         at::empty({n, blocks}, x.options().dtype(at::kInt))};
  const float* xp = x.const_data_ptr<float>();
  int8_t* qp = r.q.data_ptr<int8_t>();
  float* dp = r.d.data_ptr<float>();
  float* sp = r.s.data_ptr<float>();
  int32_t* qsp = r.qs.data_ptr<int32_t>();
  // Blocks are independent: the threads take runs of them, each at least 16 rows' worth.
  at::parallel_for(0, n * blocks, 16 * blocks, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* v = xp + b * kBlock;
      int8_t* q = qp + b * kBlock;
      float amax = 0.f;
#if defined(SEQGATE_Q8_ROWS_AVX2)
      // max(|v|, m) keeps m where v is NaN, as std::max(m, |v|) does in the loop below.
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      __m256 m = _mm256_setzero_ps();
      for (int k = 0; k < 4; ++k)
        m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + 8 * k), magnitude), m);
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
#endif
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
      qsp[b] = sum;
    }
  });
  return r;
}

inline float half(const at::Half& h) { return static_cast<float>(h); }

struct RowsView {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* qs;
  int64_t in, blocks;
};

#if defined(SEQGATE_Q8_ROWS_AVX2)
inline float sum_lanes(const __m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i broadcast4(const int8_t* p) {  // 4 bytes, 8 times over
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}
#endif

#if defined(SEQGATE_Q8_ROWS_AVX2)
// N vectors of 32 bytes from p split into their low and high nibbles (each 0..15, as bytes).
template <int N>
inline void nibbles(const uint8_t* p, __m256i (&lo)[N], __m256i (&hi)[N]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < N; ++i) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i));
    lo[i] = _mm256_and_si256(packed, low4);
    hi[i] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
  }
}

// A tile's 8 fp16 constants of one block as floats.
inline __m256 tile_constants(const at::Half* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
#endif

// ---- Q4_1 in tiles of 8 output rows -------------------------------------------------------

constexpr int kTileRows = 8;

struct Tiles {
  const uint8_t* q;    // per tile, per block: 4 x 32 bytes (the layout above)
  const at::Half* d;   // per tile, per block: 8 scales
  const at::Half* m;   // per tile, per block: 8 mins
  int64_t blocks;
};

// y[r, 8t .. 8t + 8) for n rows (at most kTileRowGroup) and tiles [begin, end). Per tile and
// block the weights are unpacked once, into 8 registers, and every row is multiplied by them:
// a row's output k of a tile sums, block by block, dot * (d * dx) in one fp32 sum (kept in
// `acc` between blocks) and m * sx in another, added at the end: the same order whatever n is.
constexpr int kTileRowGroup = 64;

#if defined(SEQGATE_Q8_ROWS_AVX2)
constexpr int kMinRows = 8;

// Rows [r0, r0 + R) of tile t: the mins' sum (m * sx, block by block) added to the scaled dots
// in `acc`, stored to y.
template <int R>
inline void mins(const Tiles& w, const RowsView& x, const at::Half* wm, int r0, const float* acc,
                 float* y, int64_t ldy, int64_t t) {
  __m256 sum[R];
  for (int i = 0; i < R; ++i) sum[i] = _mm256_setzero_ps();
  const float* s = x.s + r0 * x.blocks;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const __m256 m = tile_constants(wm + b * kTileRows);
    for (int i = 0; i < R; ++i)
      sum[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(s[i * x.blocks + b]), sum[i]);
  }
  for (int i = 0; i < R; ++i)
    _mm256_storeu_ps(y + (r0 + i) * ldy + t * kTileRows,
                     _mm256_add_ps(_mm256_load_ps(acc + (r0 + i) * kTileRows), sum[i]));
}
#endif

void tiles(const Tiles& w, const RowsView& x, int n, float* y, int64_t ldy, int64_t begin,
           int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* wq = w.q + t * w.blocks * (kBlock / 2) * kTileRows;
    const at::Half* wd = w.d + t * w.blocks * kTileRows;
    const at::Half* wm = w.m + t * w.blocks * kTileRows;
#if defined(SEQGATE_Q8_ROWS_AVX2)
    alignas(32) float acc[kTileRowGroup * kTileRows];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < n; ++r) _mm256_store_ps(acc + r * kTileRows, _mm256_setzero_ps());
    for (int64_t b = 0; b < w.blocks; ++b) {
      __m256i lo[4], hi[4];
      nibbles(wq + b * (kBlock / 2) * kTileRows, lo, hi);
      const __m256 d = tile_constants(wd + b * kTileRows);
      const int8_t* row = x.q + b * kBlock;
      for (int r = 0; r < n; ++r, row += x.in) {
        __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], broadcast4(row)),
                                        _mm256_maddubs_epi16(hi[0], broadcast4(row + 16)));
        for (int h = 1; h < 4; ++h)
          sums = _mm256_add_epi16(
              sums, _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], broadcast4(row + 4 * h)),
                                     _mm256_maddubs_epi16(hi[h], broadcast4(row + 16 + 4 * h))));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.d[r * x.blocks + b]));
        _mm256_store_ps(acc + r * kTileRows,
                        _mm256_fmadd_ps(dot, scale, _mm256_load_ps(acc + r * kTileRows)));
      }
    }
    // The mins in a pass of their own, each row's in one register, 8 rows side by side (a
    // row's sum is a chain of FMAs, one block after another: 8 chains keep the FMA unit busy).
    int r = 0;
    for (; r + kMinRows <= n; r += kMinRows) mins<kMinRows>(w, x, wm, r, acc, y, ldy, t);
    for (; r < n; ++r) mins<1>(w, x, wm, r, acc, y, ldy, t);
#else
    for (int r = 0; r < n; ++r) {
      const int8_t* row = x.q + r * x.in;
      for (int k = 0; k < kTileRows; ++k) {
        float acc = 0.f, mins = 0.f;
        for (int64_t b = 0; b < w.blocks; ++b) {
          const uint8_t* p = wq + b * (kBlock / 2) * kTileRows;
          int32_t sum = 0;
          for (int h = 0; h < 4; ++h)
            for (int c = 0; c < 4; ++c) {
              const uint8_t byte = p[32 * h + 4 * k + c];
              sum += (byte & 0x0F) * row[b * kBlock + 4 * h + c] +
                     (byte >> 4) * row[b * kBlock + 16 + 4 * h + c];
            }
          const float scale = half(wd[b * kTileRows + k]) * x.d[r * x.blocks + b];
          acc = std::fma(static_cast<float>(sum), scale, acc);
        }
        for (int64_t b = 0; b < w.blocks; ++b)
          mins = std::fma(half(wm[b * kTileRows + k]), x.s[r * x.blocks + b], mins);
        y[r * ldy + t * kTileRows + k] = acc + mins;
      }
    }
#endif
  }
}

// ---- Q8_0 in tiles of 8 output rows ------------------------------------------------------

struct Tiles8 {
  const uint8_t* q;    // per tile, per block: 8 x 32 bytes (the layout above), q + 128
  const at::Half* d;   // per tile, per block: 8 scales
  int64_t blocks;
};

// y[r, 8t .. 8t + 8) for n rows (at most kTileRowGroup) and tiles [begin, end), as `tiles`
// does for Q4_1: each stored byte w + 128 (0 .. 255) is split into its nibbles, unpacked once
// per tile and block, and the row's 4 columns broadcast are multiplied by both: sum(w * x) =
// 16 * sum(high * x) + sum(low * x) - 128 * sum(x), all in integers, so a block's dot is the
// per-row kernel's exactly (each nibble sum stays in int16: 8 * 2 * 15 * 127 < 32768).
void tiles8(const Tiles8& w, const RowsView& x, int n, float* y, int64_t ldy, int64_t begin,
            int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* wq = w.q + t * w.blocks * kBlock * kTileRows;
    const at::Half* wd = w.d + t * w.blocks * kTileRows;
#if defined(SEQGATE_Q8_ROWS_AVX2)
    alignas(32) float acc[kTileRowGroup * kTileRows];
    // Each row's int16 sums of the block's first 16 columns, between the two halves.
    alignas(32) __m256i half_sums[kTileRowGroup * 2];
    const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
    for (int r = 0; r < n; ++r) _mm256_store_ps(acc + r * kTileRows, _mm256_setzero_ps());
    for (int64_t b = 0; b < w.blocks; ++b) {
      // A block's 8 vectors split into 16 would not stay in the 16 registers: half of them, 8,
      // do, and each row's sums of the first half wait in memory for the second.
      __m256i lo[4], hi[4];
      nibbles(wq + b * kBlock * kTileRows, lo, hi);
      const int8_t* row = x.q + b * kBlock;
      for (int r = 0; r < n; ++r, row += x.in) {
        __m256i xb = broadcast4(row);
        __m256i low = _mm256_maddubs_epi16(lo[0], xb), high = _mm256_maddubs_epi16(hi[0], xb);
        for (int g = 1; g < 4; ++g) {
          xb = broadcast4(row + 4 * g);
          low = _mm256_add_epi16(low, _mm256_maddubs_epi16(lo[g], xb));
          high = _mm256_add_epi16(high, _mm256_maddubs_epi16(hi[g], xb));
        }
        _mm256_store_si256(half_sums + 2 * r, low);
        _mm256_store_si256(half_sums + 2 * r + 1, high);
      }
      nibbles(wq + b * kBlock * kTileRows + 4 * 32, lo, hi);
      const __m256 d = tile_constants(wd + b * kTileRows);
      row = x.q + b * kBlock + 16;
      for (int r = 0; r < n; ++r, row += x.in) {
        __m256i low = _mm256_load_si256(half_sums + 2 * r);
        __m256i high = _mm256_load_si256(half_sums + 2 * r + 1);
        for (int g = 0; g < 4; ++g) {
          const __m256i xb = broadcast4(row + 4 * g);
          low = _mm256_add_epi16(low, _mm256_maddubs_epi16(lo[g], xb));
          high = _mm256_add_epi16(high, _mm256_maddubs_epi16(hi[g], xb));
        }
        const int64_t rb = r * x.blocks + b;
        const __m256i dot = _mm256_sub_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(high, sixteens), _mm256_madd_epi16(low, ones)),
            _mm256_set1_epi32(128 * x.qs[rb]));
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.d[rb]));
        _mm256_store_ps(acc + r * kTileRows,
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale,
                                        _mm256_load_ps(acc + r * kTileRows)));
      }
    }
    for (int r = 0; r < n; ++r)
      _mm256_storeu_ps(y + r * ldy + t * kTileRows, _mm256_load_ps(acc + r * kTileRows));
#else
    for (int r = 0; r < n; ++r) {
      const int8_t* row = x.q + r * x.in;
      for (int k = 0; k < kTileRows; ++k) {
        float acc = 0.f;
        for (int64_t b = 0; b < w.blocks; ++b) {
          const uint8_t* p = wq + b * kBlock * kTileRows;
          int32_t sum = 0;
          for (int g = 0; g < 8; ++g)
            for (int c = 0; c < 4; ++c)
              sum += (static_cast<int32_t>(p[32 * g + 4 * k + c]) - 128) * row[b * kBlock + 4 * g + c];
          const float scale = half(wd[b * kTileRows + k]) * x.d[r * x.blocks + b];
          acc = std::fma(static_cast<float>(sum), scale, acc);
        }
        y[r * ldy + t * kTileRows + k] = acc;
      }
    }
#endif
  }
}

// ---- Q8_0, one output row at a time ---------------------------------------------------------

struct Weights {
  const int8_t* q;      // [out, in]
  const at::Half* d;    // [out, blocks]
  int64_t blocks;
};

#if defined(SEQGATE_Q8_ROWS_AVX2)
// The 8 int32 partial sums of 32 products of u (unsigned, at most 127) and s (signed, at most
// 127 in magnitude): pairs in int16 cannot saturate (2 * 127 * 127 < 32768).
inline __m256 dot(const __m256i u, const __m256i s) {
  return _mm256_cvtepi32_ps(
      _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// The scales of output row o's blocks [b0, b0 + n) times each row's (scale[r * n + b] =
// d * dx).
template <int R>
inline void block_scales(const Weights& w, const RowsView& x, int64_t o, int64_t b0, int n,
                         float* scale) {
  const at::Half* wd = w.d + o * w.blocks + b0;
  for (int r = 0; r < R; ++r) {
    const float* xd = x.d + r * x.blocks + b0;
    int b = 0;
#if defined(SEQGATE_Q8_ROWS_AVX2)
    for (; b + 8 <= n; b += 8) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b)));
      _mm256_storeu_ps(scale + r * n + b, _mm256_mul_ps(d, _mm256_loadu_ps(xd + b)));
    }
#endif
    for (; b < n; ++b) scale[r * n + b] = half(wd[b]) * xd[b];
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
template <int R>
inline void blocks(const int8_t* wq, const RowsView& x, int64_t b, const float* scale,
                   int stride, bool pair, Acc* acc) {
#if defined(SEQGATE_Q8_ROWS_AVX2)
  __m256i u[2];  // the weights' magnitudes, as unsigned bytes
  __m256i signs[2];
  const int count = pair ? 2 : 1;
  for (int k = 0; k < count; ++k) {
    signs[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (b + k) * kBlock));
    u[k] = _mm256_sign_epi8(signs[k], signs[k]);
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* row = x.q + r * x.in + b * kBlock;
    // the weights' signs moved over to the row
    const __m256i s0 = _mm256_sign_epi8(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), signs[0]);
    __m256 t = _mm256_mul_ps(_mm256_broadcast_ss(scale + r * stride), dot(u[0], s0));
    if (pair) {
      const __m256i s1 = _mm256_sign_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kBlock)), signs[1]);
      t = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + r * stride + 1), dot(u[1], s1), t);
    }
    acc[r] = _mm256_add_ps(acc[r], t);
  }
#else
  for (int r = 0; r < R; ++r) {
    float t = 0.f;
    for (int k = 0; k < (pair ? 2 : 1); ++k) {
      const int8_t* s = x.q + r * x.in + (b + k) * kBlock;
      const int8_t* p = wq + (b + k) * kBlock;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) sum += p[j] * s[j];
      t += scale[r * stride + k] * static_cast<float>(sum);
    }
    acc[r] += t;
  }
#endif
}

constexpr int kChunk = 64;  // blocks whose scales are worked out at a time (on the stack)

// y[r, o] for R rows and output rows [begin, end). Each row's sum runs in the same order
// whatever R is (`blocks`), so its result does not depend on the rows beside it.
template <int R>
void rows(const Weights& w, const RowsView& x, float* y, int64_t ldy, int64_t begin,
          int64_t end) {
  alignas(64) float scale[R * kChunk];
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* wq = w.q + o * w.blocks * kBlock;
    Acc acc[R];
#if defined(SEQGATE_Q8_ROWS_AVX2)
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#else
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
#endif
    for (int64_t b0 = 0; b0 < w.blocks; b0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, w.blocks - b0));
      block_scales<R>(w, x, o, b0, n, scale);
      int i = 0;
      for (; i + 2 <= n; i += 2) blocks<R>(wq, x, b0 + i, scale + i, n, true, acc);
      if (i < n) blocks<R>(wq, x, b0 + i, scale + i, n, false, acc);
    }
    for (int r = 0; r < R; ++r) {
#if defined(SEQGATE_Q8_ROWS_AVX2)
      y[r * ldy + o] = sum_lanes(acc[r]);
#else
      y[r * ldy + o] = acc[r];
#endif
    }
  }
}

void rows_any(int n, const Weights& w, const RowsView& x, float* y, int64_t ldy, int64_t begin,
              int64_t end) {
  switch (n) {
    case 1: return rows<1>(w, x, y, ldy, begin, end);
    case 2: return rows<2>(w, x, y, ldy, begin, end);
    case 3: return rows<3>(w, x, y, ldy, begin, end);
    case 4: return rows<4>(w, x, y, ldy, begin, end);
    case 5: return rows<5>(w, x, y, ldy, begin, end);
    case 6: return rows<6>(w, x, y, ldy, begin, end);
    case 7: return rows<7>(w, x, y, ldy, begin, end);
    default: return rows<8>(w, x, y, ldy, begin, end);
  }
}

// ---- both -------------------------------------------------------------------------------------

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

// y [rows, out] = x times the weights, `pass(rows, view, y, ldy, begin, end)` computing up to
// `max_rows` rows over units [begin, end) of `units` (output rows or tiles) `unit_rows` wide.
// Units are split across threads; every thread sees all input rows, max_rows at a time, over a
// few units whose weights stay in the core's cache between row groups.
template <typename Pass>
at::Tensor linear(const at::Tensor& input, int64_t out, int64_t units, int max_rows,
                  int64_t grain, const Pass& pass) {
  const at::Tensor x = input.to(at::kFloat).contiguous();
  const Rows rounded = round_rows(x);
  const int64_t n = x.size(0);
  const int64_t in = x.size(1), blocks = in / kBlock;
  const RowsView v{rounded.q.const_data_ptr<int8_t>(), rounded.d.const_data_ptr<float>(),
                   rounded.s.const_data_ptr<float>(), rounded.qs.const_data_ptr<int32_t>(), in,
                   blocks};
  at::Tensor y = at::empty({n, out}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u0 = begin; u0 < end; u0 += grain)
      for (int64_t r0 = 0; r0 < n; r0 += max_rows) {
        const RowsView part{v.q + r0 * in, v.d + r0 * blocks, v.s + r0 * blocks,
                            v.qs + r0 * blocks, in, blocks};
        pass(static_cast<int>(std::min<int64_t>(max_rows, n - r0)), part, yp + r0 * out, out,
             u0, std::min(u0 + grain, end));
      }
  });
  return input.scalar_type() == at::kFloat ? y : y.to(input.scalar_type());
}

}  // namespace

namespace seqgate {

// x [rows, in] float32 or bfloat16 (the result alike); q [out, in / 2] uint8, d, m [out, in / 32]
// float16, all in tiles of 8 output rows (the layout above; out a multiple of 8) -> [rows, out].
at::Tensor q4x8_q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                          const at::Tensor& m) {
  check(x, q, d, kBlock / 2);
  TORCH_CHECK(q.scalar_type() == at::kByte, "weights: uint8");
  TORCH_CHECK(m.is_contiguous() && m.scalar_type() == at::kHalf && m.sizes() == d.sizes(),
              "mins: shaped as the scales, float16 contiguous");
  TORCH_CHECK(q.size(0) % kTileRows == 0, "weights: output rows a multiple of 8 (tiles)");
  const Tiles w{q.const_data_ptr<uint8_t>(), d.const_data_ptr<at::Half>(),
                m.const_data_ptr<at::Half>(), d.size(1)};
  return linear(x, q.size(0), q.size(0) / kTileRows, kTileRowGroup, 4,
                [&](int n, const RowsView& v, float* y, int64_t ldy, int64_t b, int64_t e) {
                  tiles(w, v, n, y, ldy, b, e);
                });
}

// x [rows, in] float32 or bfloat16 (the result alike); q [out, in] uint8 (each weight + 128),
// d [out, in / 32] float16, in tiles of 8 output rows (`tiles8`; out a multiple of 8) ->
// [rows, out].
at::Tensor q8x8_q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d) {
  check(x, q, d, kBlock);
  TORCH_CHECK(q.scalar_type() == at::kByte, "weights: uint8");
  TORCH_CHECK(q.size(0) % kTileRows == 0, "weights: output rows a multiple of 8 (tiles)");
  const Tiles8 w{q.const_data_ptr<uint8_t>(), d.const_data_ptr<at::Half>(), d.size(1)};
  return linear(x, q.size(0), q.size(0) / kTileRows, kTileRowGroup, 4,
                [&](int n, const RowsView& v, float* y, int64_t ldy, int64_t b, int64_t e) {
                  tiles8(w, v, n, y, ldy, b, e);
                });
}

// x [rows, in] float32 or bfloat16; q [out, in] int8; d [out, in / 32] float16 -> [rows, out].
at::Tensor q8_q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d) {
  check(x, q, d, kBlock);
  TORCH_CHECK(q.scalar_type() == at::kChar, "weights: int8");
  const Weights w{q.const_data_ptr<int8_t>(), d.const_data_ptr<at::Half>(), d.size(1)};
  return linear(x, q.size(0), q.size(0), 8, 32,
                [&](int n, const RowsView& v, float* y, int64_t ldy, int64_t b, int64_t e) {
                  rows_any(n, w, v, y, ldy, b, e);
                });
}

}  // namespace seqgate

TORCH_LIBRARY_FRAGMENT(seqgate, m) {
  m.def("q4x8_q8_linear(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("q8_q8_linear(Tensor x, Tensor q, Tensor d) -> Tensor");
  m.def("q8x8_q8_linear(Tensor x, Tensor q, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(seqgate, CPU, m) {
  m.impl("q4x8_q8_linear", &seqgate::q4x8_q8_linear);
  m.impl("q8_q8_linear", &seqgate::q8_q8_linear);
  m.impl("q8x8_q8_linear", &seqgate::q8x8_q8_linear);
}
