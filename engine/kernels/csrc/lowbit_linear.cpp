// Linear layers over weights stored in 4, 8 or 16 bits, for forwards of a few rows, on the CPU.
//
// A decode step at low concurrency reads every weight once and does little arithmetic with
// each, so its time is the bytes it reads. These products read weights in two block formats of
// 32 input columns per output row, each block with fp16 constants, and compute in fp32:
//   q4: w = q * d + m, q in 0..15 packed two to a byte (byte j: column j low, j + 16 high);
//   q8: w = q * d,     q in -128..127.
// They are llama.cpp's Q4_1 and Q8_0, the formats the embedded model ships in: each weight is
// rebuilt with one fused multiply-add (q * d is exact in fp32, so it rounds once, as the
// de-quantiser that produced the fp32 model did) and multiplied in fp32, so for such a model the
// products use exactly the fp32 model's weights at a fifth of their bytes. Two more formats hold
// one weight in 16 bits, bf16 or fp16, for fp32 models whose weights are such values (a model
// published in bf16 or fp16 and loaded in fp32): widening them to fp32 is exact, so the products
// use the fp32 weights at half their bytes. Each output element is summed in its own order
// (per-lane partial sums, then across lanes), as any other matrix product's blocking does.
//
// Up to 15 rows, each output row's blocks are rebuilt in registers and dotted with every input
// row (bound by the weights' bytes); from 16 rows on, a tile of output rows is rebuilt into fp32
// once and multiplied as a matrix product (bound by the multiply-adds).
//
// Written over ATen's Vectorized<float>; the weights' unpacking is in intrinsics for AVX2 and
// AVX512, else a scalar loop. Registered as torch.ops.seqgate.q4_linear / q8_linear /
// h16_linear (the library is built by engine/kernels/native.py); checked in
// tests/engine/test_lowbit.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lowbit_linear.h"
#include "vec.h"

namespace {

using namespace seqgate;
constexpr int kBlock = 32;                 // input columns per block
constexpr int kPer = kBlock / kLanes;      // vectors per block
constexpr int kMaxRows = 8;                // input rows one pass over the weights serves
constexpr int64_t kTile = 32;              // output rows whose weights one pass keeps cached
constexpr int64_t kManyRows = 16;          // from this many rows on: `many_rows`

enum class Kind { Q4, Q8, BF16, F16 };

// A block's 32 q values as floats, kPer vectors.
inline void unpack_q4(const uint8_t* p, Vecs<kPer>& q) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low));
  q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high));
#elif defined(CPU_CAPABILITY_AVX2)
  // The 16 bytes in both halves of a register, each byte moved into the low byte of a 32-bit
  // lane by one in-lane shuffle (bytes 0-7, then 8-15); the low nibbles are columns 0-15, the
  // high ones 16-31. Widening with vpmovzxbd instead takes lane-crossing shuffles and byte
  // shifts, and one row's product is bound by these instructions, not by the bytes it reads.
  const __m256i b =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i first = _mm256_shuffle_epi8(
      b, _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 4, -1, -1,
                          -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1));
  const __m256i second = _mm256_shuffle_epi8(
      b, _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1, 12, -1,
                          -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1));
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, nibble));
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, nibble));
  q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
  q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
#else
  alignas(64) float f[kBlock];
  for (int j = 0; j < kBlock / 2; ++j) {
    f[j] = static_cast<float>(p[j] & 0x0F);
    f[j + kBlock / 2] = static_cast<float>(p[j] >> 4);
  }
  for (int k = 0; k < kPer; ++k) q[k] = Vec::loadu(f + k * kLanes);
#endif
}

inline void unpack_q8(const int8_t* p, Vecs<kPer>& q) {
#if defined(CPU_CAPABILITY_AVX512)
  for (int k = 0; k < 2; ++k)
    q[k] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k))));
#elif defined(CPU_CAPABILITY_AVX2)
  for (int k = 0; k < 4; ++k)
    q[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * k))));
#else
  alignas(64) float f[kBlock];
  for (int j = 0; j < kBlock; ++j) f[j] = static_cast<float>(p[j]);
  for (int k = 0; k < kPer; ++k) q[k] = Vec::loadu(f + k * kLanes);
#endif
}

// 32 bf16 or fp16 weights as floats, kPer vectors (exact: both widen to fp32 without rounding).
template <Kind K>
inline void unpack_h16(const uint16_t* p, Vecs<kPer>& q) {
#if defined(CPU_CAPABILITY_AVX512)
  for (int k = 0; k < 2; ++k) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * k));
    if constexpr (K == Kind::BF16)
      q[k] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      q[k] = _mm512_cvtph_ps(h);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (int k = 0; k < 4; ++k) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * k));
    if constexpr (K == Kind::BF16)
      q[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
      q[k] = _mm256_cvtph_ps(h);
  }
#else
  alignas(64) float f[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    if constexpr (K == Kind::BF16) {
      const uint32_t bits = static_cast<uint32_t>(p[j]) << 16;
      std::memcpy(f + j, &bits, sizeof bits);
    } else {
      at::Half h;
      std::memcpy(&h, p + j, sizeof h);
      f[j] = static_cast<float>(h);
    }
  }
  for (int k = 0; k < kPer; ++k) q[k] = Vec::loadu(f + k * kLanes);
#endif
}

struct Weights {
  const uint8_t* q;     // [out, blocks * bytes per block]
  const at::Half* d;    // [out, blocks], q4 and q8 only
  const at::Half* m;    // [out, blocks], q4 only
  int64_t blocks, row_bytes;
};

// The block constants of kScales blocks from block b of output row o as floats (`n` of them,
// the rest left as they were): one conversion of 8 where the build has F16C, instead of a
// scalar conversion and a broadcast per block and constant.
constexpr int kScales = 8;

inline void halves(const at::Half* h, int n, float* f) {
#if defined(__F16C__)
  if (n == kScales) {
    _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
    return;
  }
#endif
  for (int i = 0; i < n; ++i) f[i] = static_cast<float>(h[i]);
}

struct Scales {
  alignas(32) float d[kScales], m[kScales];
};

template <Kind K>
inline void scales_of(const Weights& w, int64_t o, int64_t b, int n, Scales& s) {
  if constexpr (K == Kind::Q4 || K == Kind::Q8) halves(w.d + o * w.blocks + b, n, s.d);
  if constexpr (K == Kind::Q4) halves(w.m + o * w.blocks + b, n, s.m);
}

// Block b of output row o as floats, its constants `s` at `i`.
template <Kind K>
inline void weights_of(const Weights& w, int64_t o, int64_t b, const Scales& s, int i,
                       Vecs<kPer>& wv) {
  const uint8_t* qrow = w.q + o * w.row_bytes;
  if constexpr (K == Kind::Q4) {
    unpack_q4(qrow + b * (kBlock / 2), wv);
    const Vec d(s.d[i]), m(s.m[i]);
    for (int k = 0; k < kPer; ++k) wv[k] = at::vec::fmadd(wv[k], d, m);
  } else if constexpr (K == Kind::Q8) {
    unpack_q8(reinterpret_cast<const int8_t*>(qrow) + b * kBlock, wv);
    const Vec d(s.d[i]);
    for (int k = 0; k < kPer; ++k) wv[k] = wv[k] * d;
  } else {
    unpack_h16<K>(reinterpret_cast<const uint16_t*>(qrow) + b * kBlock, wv);
  }
}

// f(b, wv) for each block b of output row o, rebuilt as floats (wv), in order; the constants
// converted kScales blocks at a time.
template <Kind K, typename F>
inline void for_each_block(const Weights& w, int64_t o, F&& f) {
  for (int64_t b0 = 0; b0 < w.blocks; b0 += kScales) {
    const int n = static_cast<int>(std::min<int64_t>(kScales, w.blocks - b0));
    Scales s;
    scales_of<K>(w, o, b0, n, s);
    for (int i = 0; i < n; ++i) {
      Vecs<kPer> wv;
      weights_of<K>(w, o, b0 + i, s, i, wv);
      f(b0 + i, wv);
    }
  }
}

// y[r, o] for R input rows and output rows [begin, end): each block's weights are rebuilt once
// and serve all R rows. Each row's sums are split so that a step has enough independent sums to
// keep the multiply-add units busy: one or two rows get a partial sum per vector of the block,
// three or four two each (one each left 3 rows waiting on the adds' latency: 8.4 against
// 7.1 ms a pass over the embedded model's layers, AVX2; 5 rows gained nothing), more one each.
//
// The weights of the output row kAhead rows on are fetched into the cache while this one is
// multiplied: each layer's rows stream from memory once, and the hardware's prefetch, starting
// over at every layer, fell behind.
constexpr int64_t kAhead = 4;

// Fetches output row o + kAhead where it is before `end` (the thread's last row).
template <Kind K>
inline void fetch_ahead(const Weights& w, int64_t o, int64_t end) {
  if (o + kAhead >= end) return;
  const uint8_t* q = w.q + (o + kAhead) * w.row_bytes;
  for (int64_t c = 0; c < w.row_bytes; c += 64) __builtin_prefetch(q + c);
  if constexpr (K == Kind::Q4 || K == Kind::Q8)
    __builtin_prefetch(w.d + (o + kAhead) * w.blocks);
  if constexpr (K == Kind::Q4) __builtin_prefetch(w.m + (o + kAhead) * w.blocks);
}

template <Kind K, int R>
void rows(const Weights& w, const float* x, int64_t ldx, float* y, int64_t ldy,
          int64_t begin, int64_t end, int64_t limit) {
  constexpr int A = R <= 2 ? kPer : R <= 4 ? std::min(2, kPer) : 1;
  for (int64_t o = begin; o < end; ++o) {
    fetch_ahead<K>(w, o, limit);
    Vecs<R * A> acc;
    for (int i = 0; i < R * A; ++i) acc[i] = Vec(0.f);
    for_each_block<K>(w, o, [&](int64_t b, Vecs<kPer>& wv) {
      const float* xb = x + b * kBlock;
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < kPer; ++k)
          acc[r * A + k % A] = at::vec::fmadd(wv[k], Vec::loadu(xb + r * ldx + k * kLanes),
                                              acc[r * A + k % A]);
    });
    for (int r = 0; r < R; ++r) {
      Vec s = acc[r * A];
      for (int a = 1; a < A; ++a) s = s + acc[r * A + a];
      y[r * ldy + o] = at::vec::vec_reduce_all<float>(
          [](const Vec& u, const Vec& v) { return u + v; }, s);
    }
  }
}

template <Kind K>
void rows_any(int n, const Weights& w, const float* x, int64_t ldx, float* y, int64_t ldy,
              int64_t begin, int64_t end, int64_t limit) {
  switch (n) {
    case 1: return rows<K, 1>(w, x, ldx, y, ldy, begin, end, limit);
    case 2: return rows<K, 2>(w, x, ldx, y, ldy, begin, end, limit);
    case 3: return rows<K, 3>(w, x, ldx, y, ldy, begin, end, limit);
    case 4: return rows<K, 4>(w, x, ldx, y, ldy, begin, end, limit);
    case 5: return rows<K, 5>(w, x, ldx, y, ldy, begin, end, limit);
    case 6: return rows<K, 6>(w, x, ldx, y, ldy, begin, end, limit);
    case 7: return rows<K, 7>(w, x, ldx, y, ldy, begin, end, limit);
    default: return rows<K, 8>(w, x, ldx, y, ldy, begin, end, limit);
  }
}

// Many rows: the layer as a matrix product. A tile of kOuts output rows is rebuilt once into
// fp32 (`tile`, [kOuts, in]), then multiplied by the input transposed in panels of rows (`panels`
// below): for each column k, each output's weight is broadcast and multiplied into
// NV vectors of rows, so every output element is one running sum over k in one lane and no
// sums across lanes are needed; kOuts * NV accumulators stay in registers.
constexpr int kOuts = 6;

// Rebuilds output rows [o, o + n) into tile (fp32, `in` columns each), fetching ahead up to
// `end`.
template <Kind K>
void rebuild(const Weights& w, int64_t o, int n, int64_t end, float* tile) {
  for (int i = 0; i < n; ++i) {
    float* out = tile + i * w.blocks * kBlock;
    fetch_ahead<K>(w, o + i, end);
    for_each_block<K>(w, o + i, [&](int64_t b, Vecs<kPer>& wv) {
      for (int k = 0; k < kPer; ++k) wv[k].store(out + b * kBlock + k * kLanes);
    });
  }
}

// The sums of kOuts outputs over one panel of input rows, from the rebuilt tile and the panel
// `xp` ([in, NV * kLanes], the rows transposed), stored output by output: output i's
// NV * kLanes rows at out[i * ldo ..].
template <int NV>
void outer(const float* tile, int64_t in, const float* xp, float* out, int64_t ldo) {
  Vecs<kOuts * NV> acc;
  for (int i = 0; i < kOuts * NV; ++i) acc[i] = Vec(0.f);
  for (int64_t k = 0; k < in; ++k) {
    Vec xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = Vec::loadu(xp + (k * NV + v) * kLanes);
    for (int i = 0; i < kOuts; ++i) {
      const Vec wk(tile[i * in + k]);
      for (int v = 0; v < NV; ++v) acc[i * NV + v] = at::vec::fmadd(wk, xv[v], acc[i * NV + v]);
    }
  }
  for (int i = 0; i < kOuts; ++i)
    for (int v = 0; v < NV; ++v) acc[i * NV + v].store(out + i * ldo + v * kLanes);
}

// The input rows, `padded` to whole vectors, transposed into panels of kPanel rows (the last
// one kLanes where that is all that is left), each panel [in, its rows] and zero past the last
// row: `outer` then reads each panel from one contiguous stream, where one [in, all rows]
// matrix made it step over the other rows' columns (a stride that, at 256 rows and 1,536
// columns, maps a panel onto a sixteenth of the L2's sets).
constexpr int64_t kPanel = 2 * kLanes;

at::Tensor panels(const at::Tensor& x, int64_t padded) {
  const int64_t n = x.size(0), in = x.size(1), ldx = x.stride(0);
  at::Tensor xt = at::empty({padded * in}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = xt.data_ptr<float>();
  at::parallel_for(0, (padded + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r0 = p * kPanel, width = std::min(kPanel, padded - r0);
      float* panel = dst + r0 * in;
      for (int64_t r = 0; r < width; r += 8) {
        float* dst8 = panel + r;
        if (r0 + r + 8 <= n) {
          const float* src8 = src + (r0 + r) * ldx;
          for (int64_t k = 0; k < in; k += 8)
            at::vec::transpose_mxn<float, 8, 8>(src8 + k, ldx, dst8 + k * width, width);
          continue;
        }
        for (int64_t k = 0; k < in; ++k)
          for (int64_t i = 0; i < 8; ++i)
            dst8[k * width + i] = r0 + r + i < n ? src[(r0 + r + i) * ldx + k] : 0.f;
      }
    }
  });
  return xt;
}

// Outputs whose sums `many_rows` keeps in a block of their own ([outputs, padded rows]) before
// writing them into y's rows whole: written straight into y, each tile's few outputs per row
// touched one cache line in every row, and where y's rows are a multiple of 4 KiB apart (3,072
// or 49,152 outputs) all those lines fall in one set of the L1 cache and evict each other.
constexpr int64_t kBlockOuts = 8 * kOuts;

// The block's row stride: `padded`, or a cache line more where that is a multiple of 4 KiB, so
// that the block's own rows do not fall in one set either.
constexpr int64_t kPageFloats = 4096 / sizeof(float), kLineFloats = 64 / sizeof(float);
inline int64_t block_stride(int64_t padded) {
  return padded % kPageFloats ? padded : padded + kLineFloats;
}

template <Kind K>
void many_rows(const Weights& w, const float* xt, int64_t rows, int64_t padded, float* y,
               int64_t ldy, int64_t begin, int64_t end) {
  const int64_t in = w.blocks * kBlock;
  std::vector<float> tile(static_cast<size_t>(kOuts * in));
  const int64_t ld = block_stride(padded);
  std::vector<float> block(static_cast<size_t>(kBlockOuts * ld));
  for (int64_t b0 = begin; b0 < end; b0 += kBlockOuts) {
    const int64_t b1 = std::min(b0 + kBlockOuts, end);
    for (int64_t o = b0; o < b1; o += kOuts) {
      const int outs = static_cast<int>(std::min<int64_t>(kOuts, b1 - o));
      rebuild<K>(w, o, outs, end, tile.data());
      if (outs < kOuts)  // rows past the layer's last multiply zeros, their sums unused
        std::fill(tile.begin() + outs * in, tile.end(), 0.f);
      float* out = block.data() + (o - b0) * ld;
      int64_t r0 = 0;
      for (; r0 + kPanel <= padded; r0 += kPanel)
        outer<2>(tile.data(), in, xt + r0 * in, out + r0, ld);
      if (r0 < padded) outer<1>(tile.data(), in, xt + r0 * in, out + r0, ld);
    }
    // The block [outputs, rows] into y's rows, eight by eight where whole.
    const int64_t n = b1 - b0;
    for (int64_t r = 0; r < rows; r += 8)
      for (int64_t i = 0; i < n; i += 8) {
        const float* src = block.data() + i * ld + r;
        float* dst = y + r * ldy + b0 + i;
        if (r + 8 <= rows && i + 8 <= n) {
          at::vec::transpose_mxn<float, 8, 8>(src, ld, dst, ldy);
          continue;
        }
        for (int64_t a = 0; a < 8 && r + a < rows; ++a)
          for (int64_t c = 0; c < 8 && i + c < n; ++c) dst[a * ldy + c] = src[c * ld + a];
      }
  }
}

void check(const at::Tensor& x, const at::Tensor& q, int64_t row_bytes) {
  TORCH_CHECK(x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1,
              "x: a CPU float32 or bfloat16 matrix with contiguous rows");
  TORCH_CHECK(x.size(1) % kBlock == 0, "x: columns a multiple of 32");
  const int64_t width = x.size(1) / kBlock * row_bytes / q.element_size();
  TORCH_CHECK(q.is_contiguous() && q.dim() == 2 && q.size(1) == width,
              "weights: [out, ", width, "] contiguous");
}

void check(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, int64_t row_bytes) {
  check(x, q, row_bytes);
  const int64_t blocks = x.size(1) / kBlock;
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.dim() == 2 &&
                  d.size(0) == q.size(0) && d.size(1) == blocks,
              "scales: [out, ", blocks, "] float16 contiguous");
}

// The product in fp32; bf16 rows are widened first and the result rounded back (what
// x.float() and .to(torch.bfloat16) around the call would do, without two more operator calls
// from Python per layer: at one row those cost about as much as a small layer's product).
template <Kind K>
at::Tensor linear(const at::Tensor& input, const Weights& w, int64_t out) {
  if (input.scalar_type() == at::kBFloat16)
    return linear<K>(input.to(at::kFloat), w, out).to(at::kBFloat16);
  const at::Tensor& x = input;
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), n = x.size(0);
  if (n >= kManyRows) {
    const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;  // rows in whole vectors
    const at::Tensor xt = panels(x, padded);
    const float* tp = xt.data_ptr<float>();
    at::parallel_for(0, (out + kOuts - 1) / kOuts, 1, [&](int64_t begin, int64_t end) {
      many_rows<K>(w, tp, n, padded, yp, out, begin * kOuts, std::min(end * kOuts, out));
    });
    return y;
  }
  // Output rows split across threads; every thread sees all input rows, kMaxRows at a time,
  // over a tile of output rows whose weights stay in the core's cache between row groups.
  at::parallel_for(0, out, kTile, [&](int64_t begin, int64_t end) {
    for (int64_t o0 = begin; o0 < end; o0 += kTile)
      for (int64_t r0 = 0; r0 < n; r0 += kMaxRows)
        rows_any<K>(static_cast<int>(std::min<int64_t>(kMaxRows, n - r0)), w,
                     xp + r0 * ldx, ldx, yp + r0 * out, out, o0, std::min(o0 + kTile, end),
                     end);
  });
  return y;
}

// x [rows, in] float32 or bfloat16 (the result alike); q [out, in / 2] uint8; d, m [out, in / 32]
// float16 -> [rows, out].
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                     const at::Tensor& m) {
  check(x, q, d, kBlock / 2);
  TORCH_CHECK(q.scalar_type() == at::kByte, "weights: uint8");
  TORCH_CHECK(m.is_contiguous() && m.scalar_type() == at::kHalf && m.sizes() == d.sizes(),
              "mins: shaped as the scales, float16 contiguous");
  const Weights w{q.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), m.data_ptr<at::Half>(),
                  d.size(1), q.size(1)};
  return linear<Kind::Q4>(x, w, q.size(0));
}

// x [rows, in] float32 or bfloat16; q [out, in] int8; d [out, in / 32] float16 -> [rows, out].
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d) {
  check(x, q, d, kBlock);
  TORCH_CHECK(q.scalar_type() == at::kChar, "weights: int8");
  const Weights w{reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()),
                  d.data_ptr<at::Half>(), nullptr, d.size(1), q.size(1)};
  return linear<Kind::Q8>(x, w, q.size(0));
}

// x [rows, in] float32 or bfloat16; w [out, in] bfloat16 or float16 -> [rows, out].
at::Tensor h16_linear(const at::Tensor& x, const at::Tensor& w) {
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || w.scalar_type() == at::kHalf, "weights: bfloat16 or float16");
  check(x, w, kBlock * 2);
  const Weights ws{static_cast<const uint8_t*>(w.data_ptr()), nullptr, nullptr,
                   x.size(1) / kBlock, w.size(1) * 2};
  return bf16 ? linear<Kind::BF16>(x, ws, w.size(0)) : linear<Kind::F16>(x, ws, w.size(0));
}

// engine.model.onednn.product's call, `mkldnn::_linear_pointwise(x, packed, None, "none", [],
// "")`, through the dispatcher (the operator has no C++ API of its own).
at::Tensor onednn_product(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

namespace seqgate {

at::Tensor block_product(const at::Tensor& x, int64_t kind, const at::Tensor& q,
                         const std::optional<at::Tensor>& d, const std::optional<at::Tensor>& m) {
  switch (kind) {
    case kQ4:
      TORCH_CHECK(d.has_value() && m.has_value(), "q4: scales and mins");
      return q4_linear(x, q, *d, *m);
    case kQ8:
      TORCH_CHECK(d.has_value(), "q8: scales");
      return q8_linear(x, q, *d);
    case kH16:
      return h16_linear(x, q);
    case kInt8:
      TORCH_CHECK(d.has_value(), "int8: scales");
      return int8_product(x, q, *d, std::nullopt);
    case kDense:
      return at::linear(x, q);
    case kOnednn:
      return onednn_product(x, q);
    case kQ4x8Q8:
      TORCH_CHECK(d.has_value() && m.has_value(), "q4x8 x q8: scales and mins");
      return q4x8_q8_linear(x, q, *d, *m);
    case kQ8Q8:
      TORCH_CHECK(d.has_value(), "q8 x q8: scales");
      return q8_q8_linear(x, q, *d);
    case kQ8x8Q8:
      TORCH_CHECK(d.has_value(), "q8x8 x q8: scales");
      return q8x8_q8_linear(x, q, *d);
  }
  TORCH_CHECK(false, "block kind: 0 (q4), 1 (q8), 2 (16-bit), 3 (int8), 4 (dense), ",
              "5 (oneDNN's), 6 (q4x8 x q8), 7 (q8 x q8) or 8 (q8x8 x q8), not ", kind);
}

}  // namespace seqgate

TORCH_LIBRARY_FRAGMENT(seqgate, m) {
  m.def("q4_linear(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor q, Tensor d) -> Tensor");
  m.def("h16_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(seqgate, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("h16_linear", &h16_linear);
}
