// Attention of one query token per row over a rolling batch's KV slab, on the CPU.
//
// PyTorch's CPU flash-attention kernel is built for long query blocks; with one query per row
// (grouped-query heads stacked, 3 per KV head for SmolLM2) it reads the KV at ~8 GB/s and took
// 29-40% of a decode step's CPU time at 32 rows. This kernel runs one task per (row, KV head):
// the group's query heads dot every attended key, sixteen keys at a time (each key loaded once
// for all of them; bf16 pairs into fp32 with AVX512-BF16, else converted to fp32), a two-pass
// softmax in fp32 with a vectorised exp, then the values weighted and summed in fp32 and rounded
// once to bf16. Like PyTorch's kernel, the weights are rounded to bf16 before they multiply the
// values (AVX512-BF16 only; rounded 32 at a time before the values pass). Keys the mask hides
// get weight 0: blocks of 16 hidden keys are skipped, partly hidden blocks compute and discard
// their scores; the values pass starts at the first shown key (left padding is skipped) and
// reads a hidden value row after it with weight 0 (so, as for SDPA, padding must hold finite
// values). Head dim 64 with 1-4 query heads per KV head
// is vectorised (`vectorised`); other shapes run a scalar path, which the engine leaves to
// SDPA. Checked against PyTorch's SDPA in tests/engine/test_native.py.
//
// Built on first use by engine/kernels/decode_attention.py (torch.utils.cpp_extension) for the host CPU. Without
// AVX512 only a scalar path is compiled; engine/kernels/decode_attention.py then leaves attention to SDPA.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The vector path needs AVX512 F, BW (16-bit unpacks, byte masks) and VL.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SEQGATE_AVX512 1
#include <immintrin.h>
#endif

namespace {

constexpr float kHidden = -3.0e38f;  // a hidden column's score; its weight is set to 0

inline float bf16_to_float(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as PyTorch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(SEQGATE_AVX512)
// exp(x) for x <= 0: 2^n * e^r with |r| <= ln2/2, e^r by its Taylor series to r^7 (relative
// error below 1e-7, under float's own rounding).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // NaN (the second operand) passes through
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

struct Problem {
  const uint16_t* q;  // [rows, kv_heads * groups, dim]
  const uint16_t* k;  // [rows, kv_heads, columns, dim]
  const uint16_t* v;
  const bool* mask;   // [rows, columns] (true attends), or null: every column
  uint16_t* out;      // [rows, kv_heads * groups, dim], contiguous
  int64_t rows, kv_heads, groups, columns, dim;
  int64_t q_row, q_head, k_row, k_head, k_col, v_row, v_head, v_col, mask_row;
  float scale;
};

// Scaled scores of the group's queries (fp32 copies of the bf16 ones) against every column:
// fills s[g * columns + c] (kHidden where the mask hides the column) and the per-query maxima.
void scores_generic(const Problem& pb, const uint16_t* kp, const bool* mr, const float* qf,
                    float* s, float* mx) {
  const int64_t C = pb.columns, D = pb.dim, G = pb.groups;
  std::vector<float> kf(D);
  for (int64_t c = 0; c < C; ++c) {
    if (mr && !mr[c]) {
      for (int64_t g = 0; g < G; ++g) s[g * C + c] = kHidden;
      continue;
    }
    const uint16_t* kr = kp + c * pb.k_col;
    for (int64_t d = 0; d < D; ++d) kf[d] = bf16_to_float(kr[d]);
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * kf[d];
      dot *= pb.scale;
      s[g * C + c] = dot;
      mx[g] = std::max(mx[g], dot);
    }
  }
}

#if defined(SEQGATE_AVX512)
// Sixteen vectors to one: lane i of the result is the sum of a[i]'s lanes.
inline __m512 sum16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One key's dot product with one query as a vector whose lanes sum to it.
#if defined(__AVX512BF16__)
using Query64 = __m512bh[2];
inline void load_query(const float* qf, Query64& q) {
  q[0] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qf + 16), _mm512_loadu_ps(qf));
  q[1] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qf + 48), _mm512_loadu_ps(qf + 32));
}
struct KeyRow64 { __m512bh half[2]; };
inline KeyRow64 load_key(const uint16_t* kr) {
  return {{(__m512bh)_mm512_loadu_si512(kr), (__m512bh)_mm512_loadu_si512(kr + 32)}};
}
inline __m512 dot_parts(const KeyRow64& k, const Query64& q) {
  return _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), k.half[0], q[0]), k.half[1], q[1]);
}
#else
using Query64 = __m512[4];
inline void load_query(const float* qf, Query64& q) {
  for (int i = 0; i < 4; ++i) q[i] = _mm512_loadu_ps(qf + 16 * i);
}
struct KeyRow64 { __m512 quarter[4]; };
inline KeyRow64 load_key(const uint16_t* kr) {
  return {{load_bf16x16(kr), load_bf16x16(kr + 16), load_bf16x16(kr + 32), load_bf16x16(kr + 48)}};
}
inline __m512 dot_parts(const KeyRow64& k, const Query64& q) {
  __m512 acc = _mm512_mul_ps(k.quarter[0], q[0]);
  for (int i = 1; i < 4; ++i) acc = _mm512_fmadd_ps(k.quarter[i], q[i], acc);
  return acc;
}
#endif

// dim 64, sixteen keys at a time.
template <int G>
void scores_64(const Problem& pb, const uint16_t* kp, const bool* mr, const float* qf,
               float* s, float* mx) {
  const int64_t C = pb.columns;
  Query64 qv[G];
  for (int g = 0; g < G; ++g) load_query(qf + 64 * g, qv[g]);
  const __m512 hidden = _mm512_set1_ps(kHidden), scale = _mm512_set1_ps(pb.scale);
  __m512 vmax[G];
  for (int g = 0; g < G; ++g) vmax[g] = hidden;
  int64_t c = 0;
  __m512 parts[G][16];
  for (; c + 16 <= C; c += 16) {
    const __mmask16 shown = mr ? _mm_cmpneq_epi8_mask(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(mr + c)), _mm_setzero_si128())
                               : static_cast<__mmask16>(0xffff);
    if (!shown) {
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(s + g * C + c, hidden);
      continue;
    }
    for (int i = 0; i < 16; ++i) {  // each key loaded once for the group's queries
      const KeyRow64 key = load_key(kp + (c + i) * pb.k_col);
      for (int g = 0; g < G; ++g) parts[g][i] = dot_parts(key, qv[g]);
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sc =
          _mm512_mask_blend_ps(shown, hidden, _mm512_mul_ps(sum16(parts[g]), scale));
      _mm512_storeu_ps(s + g * C + c, sc);
      vmax[g] = _mm512_max_ps(vmax[g], sc);
    }
  }
  for (int g = 0; g < G; ++g) mx[g] = _mm512_reduce_max_ps(vmax[g]);
  for (; c < C; ++c) {
    for (int g = 0; g < G; ++g) {
      float dot = kHidden;
      if (!mr || mr[c])
        dot = _mm512_reduce_add_ps(dot_parts(load_key(kp + c * pb.k_col), qv[g])) * pb.scale;
      s[g * C + c] = dot;
      mx[g] = std::max(mx[g], dot);
    }
  }
}

template <int G>
void weighted_values_64(const Problem& pb, const uint16_t* vp, const bool* mr, const float* s,
                        const float* inv, uint16_t* out, uint16_t* wb) {
  const int64_t C = pb.columns;
  alignas(64) float tmp[64];
#if defined(__AVX512BF16__)
  // Two keys at a time: their value rows interleaved as bf16 pairs, each pair dotted with the
  // two keys' weights (rounded to bf16, as the kernels PyTorch ships do). Accumulator lanes
  // hold dims in unpack order; put back in order at the end.
  //
  // The weights are rounded once, 32 at a time, into `wb` (a group's row every `C + 2`), where
  // columns (c, c + 1) for an even c are one 32-bit pair to broadcast; a zero follows the last
  // column. Columns before the first one shown are skipped (left padding); a hidden column
  // after it has weight 0.
  const int64_t W = C + 2;
  for (int g = 0; g < G; ++g) {
    const float* sg = s + g * C;
    uint16_t* wg = wb + g * W;
    int64_t c = 0;
    for (; c + 32 <= C; c += 32)
      _mm512_storeu_si512(wg + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sg + c + 16),
                                                              _mm512_loadu_ps(sg + c)));
    const int64_t left = C - c;  // 0-31 columns, then the zero
    const __mmask16 lo = static_cast<__mmask16>(left >= 16 ? 0xffff : (1u << left) - 1);
    const __mmask16 hi = static_cast<__mmask16>(left <= 16 ? 0 : (1u << (left - 16)) - 1);
    const __m512bh rest = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, sg + c + 16),
                                              _mm512_maskz_loadu_ps(lo, sg + c));
    _mm512_mask_storeu_epi16(wg + c, static_cast<__mmask32>((1ull << (left + 1)) - 1),
                             (__m512i)rest);
  }
  int64_t first = 0;
  if (mr) {
    while (first + 64 <= C && !_mm512_test_epi8_mask(
               _mm512_loadu_si512(mr + first), _mm512_set1_epi8(1)))
      first += 64;
    while (first < C && !mr[first]) ++first;
  }
  __m512 acc[4 * G];
  for (int i = 0; i < 4 * G; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t c = first & ~int64_t{1}; c < C; c += 2) {
    const uint16_t* r0 = vp + c * pb.v_col;
    const __m512i a0 = _mm512_loadu_si512(r0), a1 = _mm512_loadu_si512(r0 + 32);
    __m512i b0 = zero, b1 = zero;
    if (c + 1 < C) {
      const uint16_t* r1 = r0 + pb.v_col;
      b0 = _mm512_loadu_si512(r1);
      b1 = _mm512_loadu_si512(r1 + 32);
    }
    const __m512bh p0 = (__m512bh)_mm512_unpacklo_epi16(a0, b0);
    const __m512bh p1 = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
    const __m512bh p2 = (__m512bh)_mm512_unpacklo_epi16(a1, b1);
    const __m512bh p3 = (__m512bh)_mm512_unpackhi_epi16(a1, b1);
    for (int g = 0; g < G; ++g) {
      int32_t bits;
      std::memcpy(&bits, wb + g * W + c, sizeof bits);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(bits);
      acc[4 * g] = _mm512_dpbf16_ps(acc[4 * g], p0, w);
      acc[4 * g + 1] = _mm512_dpbf16_ps(acc[4 * g + 1], p1, w);
      acc[4 * g + 2] = _mm512_dpbf16_ps(acc[4 * g + 2], p2, w);
      acc[4 * g + 3] = _mm512_dpbf16_ps(acc[4 * g + 3], p3, w);
    }
  }
  // Lane l of an unpacked vector holds dim 8 * (l / 4) + l % 4 (+4 for the "hi" half).
  alignas(64) float raw[64];
  for (int g = 0; g < G; ++g) {
    const __m512 f = _mm512_set1_ps(inv[g]);
    for (int j = 0; j < 4; ++j) _mm512_store_ps(raw + 16 * j, _mm512_mul_ps(acc[4 * g + j], f));
    for (int half = 0; half < 2; ++half)
      for (int hl = 0; hl < 2; ++hl)
        for (int l = 0; l < 16; ++l)
          tmp[32 * half + 8 * (l / 4) + 4 * hl + l % 4] = raw[16 * (2 * half + hl) + l];
    for (int d = 0; d < 64; ++d) out[g * 64 + d] = float_to_bf16(tmp[d]);
  }
#else
  __m512 acc[4 * G];
  for (int i = 0; i < 4 * G; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    if (mr && !mr[c]) continue;
    const uint16_t* vr = vp + c * pb.v_col;
    const __m512 v0 = load_bf16x16(vr), v1 = load_bf16x16(vr + 16);
    const __m512 v2 = load_bf16x16(vr + 32), v3 = load_bf16x16(vr + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(s[g * C + c]);
      acc[4 * g] = _mm512_fmadd_ps(w, v0, acc[4 * g]);
      acc[4 * g + 1] = _mm512_fmadd_ps(w, v1, acc[4 * g + 1]);
      acc[4 * g + 2] = _mm512_fmadd_ps(w, v2, acc[4 * g + 2]);
      acc[4 * g + 3] = _mm512_fmadd_ps(w, v3, acc[4 * g + 3]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 f = _mm512_set1_ps(inv[g]);
    for (int j = 0; j < 4; ++j) _mm512_store_ps(tmp + 16 * j, _mm512_mul_ps(acc[4 * g + j], f));
    for (int d = 0; d < 64; ++d) out[g * 64 + d] = float_to_bf16(tmp[d]);
  }
#endif
}
#endif

void weighted_values_generic(const Problem& pb, const uint16_t* vp, const bool* mr,
                             const float* s, const float* inv, uint16_t* out) {
  const int64_t C = pb.columns, D = pb.dim, G = pb.groups;
  std::vector<float> acc(G * D, 0.f);
  for (int64_t c = 0; c < C; ++c) {
    if (mr && !mr[c]) continue;
    const uint16_t* vr = vp + c * pb.v_col;
    for (int64_t g = 0; g < G; ++g) {
      const float w = s[g * C + c];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += w * bf16_to_float(vr[d]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = float_to_bf16(acc[g * D + d] * inv[g]);
}

// Turns scores into unnormalised weights in place; returns 1 / their sum per query.
void softmax(const Problem& pb, float* s, const float* mx, float* inv) {
  const int64_t C = pb.columns;
  for (int64_t g = 0; g < pb.groups; ++g) {
    float* sg = s + g * C;
    float total = 0.f;
    int64_t c = 0;
#if defined(SEQGATE_AVX512)
    const __m512 m = _mm512_set1_ps(mx[g]);
    const __m512 hidden = _mm512_set1_ps(kHidden);
    __m512 sum = _mm512_setzero_ps();
    for (; c + 16 <= C; c += 16) {
      const __m512 x = _mm512_loadu_ps(sg + c);
      const __mmask16 shown = _mm512_cmp_ps_mask(x, hidden, _CMP_NEQ_UQ);  // NaN: shown
      const __m512 e = _mm512_maskz_mov_ps(shown, exp_ps(_mm512_sub_ps(x, m)));
      _mm512_storeu_ps(sg + c, e);
      sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; c < C; ++c) {
      const float e = sg[c] != kHidden ? std::exp(sg[c] - mx[g]) : 0.f;
      sg[c] = e;
      total += e;
    }
    inv[g] = 1.f / total;
  }
}

template <int G>
void run_task(const Problem& pb, int64_t task, std::vector<float>& s, std::vector<float>& qf,
              std::vector<uint16_t>& wb) {
  const int64_t r = task / pb.kv_heads, h = task % pb.kv_heads;
  const int64_t groups = G > 0 ? G : pb.groups, D = pb.dim;
  const uint16_t* kp = pb.k + r * pb.k_row + h * pb.k_head;
  const uint16_t* vp = pb.v + r * pb.v_row + h * pb.v_head;
  const bool* mr = pb.mask ? pb.mask + r * pb.mask_row : nullptr;
  float mx[64], inv[64];
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* qp = pb.q + r * pb.q_row + (h * groups + g) * pb.q_head;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = bf16_to_float(qp[d]);
    mx[g] = kHidden;
  }
  uint16_t* out = pb.out + (r * pb.kv_heads + h) * groups * D;
#if defined(SEQGATE_AVX512)
  if constexpr (G > 0) {
    scores_64<G>(pb, kp, mr, qf.data(), s.data(), mx);
    softmax(pb, s.data(), mx, inv);
    weighted_values_64<G>(pb, vp, mr, s.data(), inv, out, wb.data());
    return;
  }
#endif
  scores_generic(pb, kp, mr, qf.data(), s.data(), mx);
  softmax(pb, s.data(), mx, inv);
  weighted_values_generic(pb, vp, mr, s.data(), inv, out);
}

template <int G>
void run_all(const Problem& pb) {
  at::parallel_for(0, pb.rows * pb.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(pb.groups * pb.columns), qf(pb.groups * pb.dim);
    std::vector<uint16_t> wb(pb.groups * (pb.columns + 2));
    for (int64_t t = begin; t < end; ++t) run_task<G>(pb, t, s, qf, wb);
  });
}

}  // namespace

// query [rows, heads, dim]; key, value [rows, kv_heads, columns, dim] (any strides but the last
// dim's); mask [rows, columns] bool or undefined. bf16 throughout; returns [rows, heads, dim].
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key,
                               const torch::Tensor& value, const c10::optional<torch::Tensor>& mask,
                               double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && value.sizes() == key.sizes(), "shapes");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
              value.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "the head dim must be contiguous");
  Problem pb{};
  pb.rows = key.size(0);
  pb.kv_heads = key.size(1);
  pb.columns = key.size(2);
  pb.dim = key.size(3);
  TORCH_CHECK(pb.kv_heads > 0 && query.size(0) == pb.rows && query.size(2) == pb.dim &&
              query.size(1) % pb.kv_heads == 0, "query shape");
  pb.groups = query.size(1) / pb.kv_heads;
  TORCH_CHECK(pb.groups <= 64, "at most 64 query heads per KV head");
  auto out = torch::empty({pb.rows, query.size(1), pb.dim}, query.options());
  pb.q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  pb.k = reinterpret_cast<const uint16_t*>(key.data_ptr());
  pb.v = reinterpret_cast<const uint16_t*>(value.data_ptr());
  pb.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  pb.q_row = query.stride(0);
  pb.q_head = query.stride(1);
  pb.k_row = key.stride(0);
  pb.k_head = key.stride(1);
  pb.k_col = key.stride(2);
  pb.v_row = value.stride(0);
  pb.v_head = value.stride(1);
  pb.v_col = value.stride(2);
  pb.scale = static_cast<float>(scale);
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 &&
                mask->size(0) == pb.rows && mask->size(1) == pb.columns && mask->stride(1) == 1,
                "mask [rows, columns] bool");
    pb.mask = mask->data_ptr<bool>();
    pb.mask_row = mask->stride(0);
  }
  if (pb.dim == 64 && pb.groups == 1) run_all<1>(pb);
  else if (pb.dim == 64 && pb.groups == 2) run_all<2>(pb);
  else if (pb.dim == 64 && pb.groups == 3) run_all<3>(pb);
  else if (pb.dim == 64 && pb.groups == 4) run_all<4>(pb);
  else run_all<0>(pb);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Like PyTorch's own operators, the kernel lets other Python threads run (the server's).
  m.def("decode_attention", &decode_attention, "one-query attention over a KV slab (bf16, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("vectorised", [](int64_t dim, int64_t groups) {
#if defined(SEQGATE_AVX512)
    return dim == 64 && groups >= 1 && groups <= 4;
#else
    return false;
#endif
  }, "whether heads of this size, this many per KV head, take the vector path");
  m.def("instruction_set", []() -> std::string {
#if defined(SEQGATE_AVX512) && defined(__AVX512BF16__)
    return "avx512-bf16";
#elif defined(SEQGATE_AVX512)
    return "avx512";
#else
    return "scalar";
#endif
  });
}
