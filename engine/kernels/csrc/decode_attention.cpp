// Attention of a few query tokens per row over a rolling batch's KV slab, on the CPU: one per
// row in a decode step; the pending token and its draft, each with its own mask row, in a step
// that verifies drafts.
//
// PyTorch's CPU flash-attention kernel is built for long query blocks; with one query per row
// it reads the KV slowly and took 29-40% of a decode step's CPU time at 32 rows. This kernel
// runs one task per (row, KV head, query position): the group's query heads dot every shown key
// (each key loaded once for all of them), a two-pass softmax in fp32, then the values weighted
// and summed in fp32 and rounded once to the output's type. Keys the mask hides get weight 0 and
// their rows are not read, except keys' rows in a block that also shows some (their scores are
// computed and discarded). A row's positions are consecutive tasks, so the later ones find its
// keys and values in the cache; each position's arithmetic is what a call with it alone does.
//
// One source for every CPU: it is written over ATen's Vectorized<float>, whose implementation
// (AVX512, AVX2, NEON) the CPU_CAPABILITY_* macro the build defines picks; templated on the
// element types (bf16; fp32, with fp32 or float16 keys and values), head size and query heads
// per KV head. Built on first use by engine/kernels/native.py; registered as
// torch.ops.seqgate.*. Checked against PyTorch's SDPA in tests/engine/test_native.py.
//
// On a CPU with AVX512-BF16, bf16 keys are dotted with the query by its pair instruction
// (`scores_bf16_dot`, chosen at run time), without widening them to fp32.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

using namespace seqgate;

// Vector registers a loop's accumulators and operands may take (one left for a broadcast).
constexpr int kRegs = kLanes >= 16 ? 31 : 15;
constexpr float kHidden = -std::numeric_limits<float>::infinity();
// Query positions per row it takes: a step's pending token and a draft, or a contrastive row's
// candidates (at most 16, engine.sample.contrastive), or a short prompt chunk; a longer chunk
// goes to PyTorch's flash kernel, built for long query blocks.
constexpr int64_t kMaxPositions = 16;

struct Problem {
  const void *q, *k, *v;
  const bool* mask;  // [rows, positions or 1, columns] (true attends), or null: every column
  void* out;         // [rows, positions, kv_heads * groups, dim], contiguous
  int64_t kv_heads, columns;
  int64_t q_row, q_head, k_row, k_head, k_col, v_row, v_head, v_col, mask_row;
  float scale;
  int64_t positions = 1;  // query positions per row (1 + a draft's length)
  int64_t q_pos = 0;      // the query's stride between positions
  int64_t mask_pos = 0;   // the mask's stride between positions (0: one row for all)
};

// A task's row, KV head and query position: a row's positions are consecutive tasks.
struct Task {
  int64_t r, h, j;
};
inline Task task_of(const Problem& p, int64_t t) {
  return {t / (p.kv_heads * p.positions), t / p.positions % p.kv_heads, t % p.positions};
}

// How many of the `n` columns from `c0` the mask row shows (all of them without a mask).
inline int shown_in(const bool* mr, int64_t c0, int n) {
  if (!mr) return n;
  int shown = 0;
  for (int i = 0; i < n; ++i) shown += mr[c0 + i];
  return shown;
}

// A task's keys, values and mask row (null keys: none). A row's last position's task fetches the
// next row's (or KV head's) into the cache as it goes, keys while it dots its own, values while
// it weighs its own: every task's rows are streams of their own in memory, and fetched only as
// they are read, the reads waited on the memory (30 layers at 32 rows and 320 columns took
// 12.3 ms from memory, 7.2 ms with the KV in cache). A row's other positions read its own rows,
// already in the cache.
template <typename T>
struct Next {
  const T* k = nullptr;
  const T* v = nullptr;
  const bool* mask = nullptr;
};

// Fetches into the cache (Locality: __builtin_prefetch's) the rows [c0, c1) of `rows` (a task's
// keys or values, `stride` elements apart) that `mask` shows (null: all).
template <typename T, int D, int Locality>
inline void fetch_shown(const T* rows, int64_t stride, const bool* mask, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c)
    if (!mask || mask[c]) prefetch_row<T, D, Locality>(rows + c * stride);
}

// The start of a block of kLanes columns from `c0` that shows `shown` of them: the next task's
// keys of these columns are fetched into the cache (L2: this task's rows keep L1); none shown,
// its scores are kHidden and false is returned (nothing to read).
template <typename T, int D, int G>
inline bool begin_block(const Problem& p, const Next<T>& next, int64_t c0, int n, int shown,
                        float* s, int64_t padded) {
  if (next.k) fetch_shown<T, D, 2>(next.k, p.k_col, next.mask, c0, c0 + n);
  if (shown == 0) {
    for (int g = 0; g < G; ++g) Vec(kHidden).store(s + g * padded + c0);
    return false;
  }
  return true;
}

// A block of kLanes columns' scores from its dot products' lane sums (`parts`: per query,
// kLanes vectors, one per column): each column's lanes summed, times `scale`; hidden columns
// and those past the last set to kHidden; each query's running maximum updated.
template <int G>
inline void finish_block(float* parts, float* s, int64_t padded, int64_t c0, int n, int shown,
                         const bool* mr, const Vec& scale, Vecs<G>& vmax) {
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * padded + c0;
    Vecs<kLanes> dots;
    for (int i = 0; i < kLanes; ++i) dots[i] = Vec::loadu(parts + (g * kLanes + i) * kLanes);
    (sum_lanes(dots) * scale).store(sg);
    if (shown < kLanes)  // a block at the edge of the mask, or the last
      for (int i = 0; i < kLanes; ++i)
        if (i >= n || (mr && !mr[c0 + i])) sg[i] = kHidden;
    vmax[g] = at::vec::maximum(vmax[g], Vec::loadu(sg));
  }
}

// Keys dotted at once: as many (a divisor of 8, at most 8: more would spill their pointers) as
// leave a register for the key beside the accumulators; the query's vector is an operand the FMA
// reads from memory. Each query vector loaded serves them all, and fewer loads a key is what the
// dot products were waiting on.
constexpr int keys_at_once(int groups) {
  int keys = 8;
  while (keys > 1 && keys * groups > kRegs - 1) keys /= 2;
  return keys;
}

// Scores of the group's queries (qf) against every key of one (row, KV head) into s, hidden
// keys and the padding after the last as kHidden; returns each query's maximum.
template <typename T, int D, int G>
void scores(const Problem& p, const T* kp, const bool* mr, const Next<T>& next, const float* qf,
            float* s, float* parts, int64_t padded, float* mx) {
  constexpr int kKeys = keys_at_once(G);
  Vecs<G> vmax;
  for (int g = 0; g < G; ++g) vmax[g] = Vec(kHidden);
  for (int64_t c0 = 0; c0 < p.columns; c0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, p.columns - c0));
    const int shown = shown_in(mr, c0, n);
    if (!begin_block<T, D, G>(p, next, c0, n, shown, s, padded)) continue;
    for (int i = 0; i < n; i += kKeys) {
      Vecs<kKeys * G> acc;
      const T* key[kKeys];  // past the last column: the last again, its scores discarded
      for (int b = 0; b < kKeys; ++b) {
        key[b] = kp + std::min<int64_t>(c0 + i + b, p.columns - 1) * p.k_col;
        for (int g = 0; g < G; ++g) acc[b * G + g] = Vec(0.f);
      }
#pragma GCC unroll 16  // whole, or GCC keeps the accumulators in memory
      for (int j = 0; j < D; j += kLanes)
        for (int b = 0; b < kKeys; ++b) {
          const Vec kv = load(key[b] + j);
          for (int g = 0; g < G; ++g)
            acc[b * G + g] = at::vec::fmadd(kv, Vec::loadu(qf + g * D + j), acc[b * G + g]);
        }
      for (int b = 0; b < kKeys; ++b)
        for (int g = 0; g < G; ++g) acc[b * G + g].store(parts + (g * kLanes + i + b) * kLanes);
    }
    finish_block<G>(parts, s, padded, c0, n, shown, mr, Vec(1.f), vmax);  // qf holds the scale
  }
  for (int g = 0; g < G; ++g)
    mx[g] = at::vec::vec_reduce_all([](Vec a, Vec b) { return at::vec::maximum(a, b); }, vmax[g]);
}

#if defined(CPU_CAPABILITY_AVX512)
// Whether the CPU multiplies bf16 pairs into fp32 sums in one instruction (AVX512-BF16's
// vdpbf16ps): Zen 4, Cooper Lake, Sapphire Rapids and later.
const bool kBf16Dot = __builtin_cpu_supports("avx512bf16");

// `scores` for bf16 keys on such a CPU: each pair of a key's elements is multiplied by the
// query's and summed into an fp32 lane by vdpbf16ps, with no widening of the key to fp32 (a
// third of the instructions of widening it and multiplying in fp32). A product of two bf16 is
// exact in fp32, so only the order of the sums differs from `scores`. The query is taken as
// it is (bf16) and the scale applied to its sums.
template <int D, int G>
__attribute__((target("avx512bf16"))) void scores_bf16_dot(
    const Problem& p, const at::BFloat16* kp, const bool* mr, const Next<at::BFloat16>& next,
    const at::BFloat16* q, float* s, float* parts, int64_t padded, float* mx) {
  // Its own count: the queries' pairs stay in registers here (not timed with keys_at_once's).
  constexpr int kKeys = G >= 5 ? 1 : G >= 3 ? 2 : G == 2 ? 4 : 8;
  constexpr int kPairs = D / 32;  // a register holds 32 bf16
  static_assert(kLanes == 16 && D % 32 == 0);
  __m512bh qv[G * kPairs];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < kPairs; ++j)
      qv[g * kPairs + j] = (__m512bh)_mm512_loadu_si512(q + g * p.q_head + j * 32);
  const Vec scale(p.scale);
  Vecs<G> vmax;
  for (int g = 0; g < G; ++g) vmax[g] = Vec(kHidden);
  for (int64_t c0 = 0; c0 < p.columns; c0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, p.columns - c0));
    const int shown = shown_in(mr, c0, n);
    if (!begin_block<at::BFloat16, D, G>(p, next, c0, n, shown, s, padded)) continue;
    for (int i = 0; i < n; i += kKeys) {
      __m512 acc[kKeys * G];
      const at::BFloat16* key[kKeys];
      for (int b = 0; b < kKeys; ++b) {
        key[b] = kp + std::min<int64_t>(c0 + i + b, p.columns - 1) * p.k_col;
        for (int g = 0; g < G; ++g) acc[b * G + g] = _mm512_setzero_ps();
      }
      for (int j = 0; j < kPairs; ++j)
        for (int b = 0; b < kKeys; ++b) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(key[b] + j * 32);
          for (int g = 0; g < G; ++g)
            acc[b * G + g] = _mm512_dpbf16_ps(acc[b * G + g], kv, qv[g * kPairs + j]);
        }
      for (int b = 0; b < kKeys; ++b)
        for (int g = 0; g < G; ++g)
          _mm512_storeu_ps(parts + (g * kLanes + i + b) * kLanes, acc[b * G + g]);
    }
    finish_block<G>(parts, s, padded, c0, n, shown, mr, scale, vmax);
  }
  for (int g = 0; g < G; ++g)
    mx[g] = at::vec::vec_reduce_all([](Vec a, Vec b) { return at::vec::maximum(a, b); }, vmax[g]);
}
#endif

// Scores into unnormalised weights, in place; returns 1 / their sum per query. A NaN among the
// scores (a NaN maximum) makes every weight, so the whole output, NaN, as with SDPA.
template <int G>
void softmax(float* s, int64_t padded, const float* mx, float* inv) {
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * padded;
    const Vec m(mx[g]);
    Vec sum(0.f);
    for (int64_t c = 0; c < padded; c += kLanes) {
      const Vec x = Vec::loadu(sg + c) - m;
      const Vec e = Vec::blendv(x.exp_u20(), x, x.isnan());  // exp_u20 would drop a NaN
      e.store(sg + c);
      sum = sum + e;
    }
    inv[g] = 1.f / at::vec::vec_reduce_all([](Vec a, Vec b) { return a + b; }, sum);
  }
}

// The largest divisor of n not above most (at least 1).
constexpr int divisor_upto(int n, int most) {
  for (int d = most; d > 1; --d)
    if (n % d == 0) return d;
  return 1;
}

// out[g] = inv[g] * sum of the shown values weighted by w[g]. The head's vectors are summed in
// passes of as many as the registers hold (accumulators for each query and its weight, one value
// vector at a time; from 8 queries on AVX2 the weights no longer fit and are broadcast again),
// over chunks of columns whose values stay in L1 from one pass to the next.
template <typename T, int D, int G>
void weighted_values(const Problem& p, const T* vp, const bool* mr, const Next<T>& next,
                     const float* w, int64_t padded, const float* inv, float* out) {
  constexpr int kVecs = D / kLanes;
  constexpr int kPass = divisor_upto(kVecs, (kRegs - G) / G);
  constexpr int64_t kChunk = 16384 / (D * sizeof(T));  // 16 KB of values
  for (int i = 0; i < G * D; i += kLanes) Vec(0.f).store(out + i);
  for (int64_t c0 = 0; c0 < p.columns; c0 += kChunk) {
    const int64_t c1 = std::min(p.columns, c0 + kChunk);
    for (int j0 = 0; j0 < kVecs; j0 += kPass) {
      Vecs<G * kPass> acc;
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < kPass; ++j)
          acc[g * kPass + j] = Vec::loadu(out + g * D + (j0 + j) * kLanes);
      for (int64_t c = c0; c < c1; ++c) {
        if (j0 == 0 && next.v) fetch_shown<T, D, 2>(next.v, p.v_col, next.mask, c, c + 1);
        if (mr && !mr[c]) continue;
        const T* vr = vp + c * p.v_col;
        Vecs<G> wc;
        for (int g = 0; g < G; ++g) wc[g] = Vec(w[g * padded + c]);
        for (int j = 0; j < kPass; ++j) {
          const Vec value = load(vr + (j0 + j) * kLanes);
          for (int g = 0; g < G; ++g)
            acc[g * kPass + j] = at::vec::fmadd(wc[g], value, acc[g * kPass + j]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < kPass; ++j) acc[g * kPass + j].store(out + g * D + (j0 + j) * kLanes);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < D; i += kLanes)
      (Vec::loadu(out + g * D + i) * Vec(inv[g])).store(out + g * D + i);
}

// A task's keys, values and mask row.
template <typename KV>
Next<KV> rows_of(const Problem& p, int64_t task) {
  const Task t = task_of(p, task);
  return {static_cast<const KV*>(p.k) + t.r * p.k_row + t.h * p.k_head,
          static_cast<const KV*>(p.v) + t.r * p.v_row + t.h * p.v_head,
          p.mask ? p.mask + t.r * p.mask_row + t.j * p.mask_pos : nullptr};
}

// One (row, KV head, query position). Scratch: the query (scaled, fp32), the scores then weights
// (`padded` per query), a block's dot products and the output in fp32.
// T: the query's and output's type; KV: the keys' and values' (T, or float16 under an fp32 query:
// a 16-bit KV cache halves the bytes a step reads).
template <typename T, typename KV, int D, int G>
void attend(const Problem& p, int64_t task, const Next<KV>& next, int64_t padded,
            float* scratch) {
  const Task t = task_of(p, task);
  float *qf = scratch, *s = qf + G * D, *parts = s + G * padded, *of = parts + G * kLanes * kLanes;
  const T* q = static_cast<const T*>(p.q) + t.r * p.q_row + t.h * G * p.q_head + t.j * p.q_pos;
  const Next<KV> own = rows_of<KV>(p, task);
  const KV *kp = own.k, *vp = own.v;
  const bool* mr = own.mask;
  T* out = static_cast<T*>(p.out) + ((t.r * p.positions + t.j) * p.kv_heads + t.h) * G * D;
  float mx[G], inv[G];
  bool dotted = false;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KV, at::BFloat16> &&
                D % 32 == 0) {
    if (kBf16Dot) {
      scores_bf16_dot<D, G>(p, kp, mr, next, q, s, parts, padded, mx);
      dotted = true;
    }
  }
#endif
  if (!dotted) {  // the query scaled into fp32, then dotted with each key widened to fp32
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < D; j += kLanes)
        (load(q + g * p.q_head + j) * Vec(p.scale)).store(qf + g * D + j);
    scores<KV, D, G>(p, kp, mr, next, qf, s, parts, padded, mx);
  }
  softmax<G>(s, padded, mx, inv);
  if constexpr (std::is_same_v<T, float>) {
    weighted_values<KV, D, G>(p, vp, mr, next, s, padded, inv, out);
  } else {
    weighted_values<KV, D, G>(p, vp, mr, next, s, padded, inv, of);
    at::vec::convert(of, out, G * D);
  }
}

template <typename T, typename KV, int D, int G>
void run(const Problem& p, int64_t tasks) {
  const int64_t padded = (p.columns + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(G * (2 * D + padded + kLanes * kLanes));
    const Next<KV> first = rows_of<KV>(p, begin);  // nothing fetched it: its first rows now
    const int64_t ahead = std::min<int64_t>(p.columns, 32);
    fetch_shown<KV, D, 3>(first.k, p.k_col, first.mask, 0, ahead);
    fetch_shown<KV, D, 3>(first.v, p.v_col, first.mask, 0, ahead);
    // The next task's rows are fetched ahead unless it is this row's next position (its keys
    // and values are this task's).
    for (int64_t t = begin; t < end; ++t)
      attend<T, KV, D, G>(p, t,
                          t + 1 < end && (t + 1) % p.positions == 0 ? rows_of<KV>(p, t + 1)
                                                                    : Next<KV>{},
                          padded, scratch.data());
  });
}

// What is instantiated: bf16 queries over bf16 KV, fp32 ones over fp32 or float16 KV; head sizes
// 64 and 128, 1 to 8 query heads per KV head.
using Run = void (*)(const Problem&, int64_t);

template <typename T, typename KV, int D, int... G>
Run pick_group(int64_t groups, std::integer_sequence<int, G...>) {
  Run f = nullptr;
  ((groups == G ? (f = &run<T, KV, D, G>) : nullptr), ...);
  return f;
}

template <typename T, typename KV>
Run pick_dim(int64_t dim, int64_t groups) {
  using Groups = std::integer_sequence<int, 1, 2, 3, 4, 5, 6, 7, 8>;
  if (dim == 64) return pick_group<T, KV, 64>(groups, Groups{});
  if (dim == 128) return pick_group<T, KV, 128>(groups, Groups{});
  return nullptr;
}

// The query's dtype and the KV's: bf16 with bf16, fp32 with fp32 or float16.
Run pick(at::ScalarType dtype, at::ScalarType kv_dtype, int64_t dim, int64_t groups) {
  if (dtype == at::kBFloat16 && kv_dtype == at::kBFloat16)
    return pick_dim<at::BFloat16, at::BFloat16>(dim, groups);
  if (dtype == at::kFloat && kv_dtype == at::kFloat) return pick_dim<float, float>(dim, groups);
  if (dtype == at::kFloat && kv_dtype == at::kHalf) return pick_dim<float, at::Half>(dim, groups);
  return nullptr;
}

// The kernel's preconditions, all of them and only here: a call that breaks one gets None and
// the caller runs SDPA, so no second copy of these checks can disagree with the kernel.
Run fits(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const std::optional<at::Tensor>& mask) {
  if (q.dim() != 4 || k.dim() != 4 || v.sizes() != k.sizes() || !q.device().is_cpu() ||
      !k.device().is_cpu() || !v.device().is_cpu() || v.scalar_type() != k.scalar_type())
    return nullptr;
  const int64_t rows = k.size(0), kv_heads = k.size(1), columns = k.size(2), dim = k.size(3);
  const int64_t positions = q.size(2);
  if (q.size(0) != rows || positions == 0 || positions > kMaxPositions || q.size(3) != dim ||
      kv_heads == 0 ||
      columns == 0 || q.size(1) % kv_heads != 0 || q.stride(3) != 1 || k.stride(3) != 1 ||
      v.stride(3) != 1)
    return nullptr;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    if (m.scalar_type() != at::kBool || m.dim() != 4 || !m.device().is_cpu() ||
        m.size(0) != rows || m.size(1) != 1 || (m.size(2) != 1 && m.size(2) != positions) ||
        m.size(3) != columns ||
        (m.stride(3) != 1 && columns > 1))
      return nullptr;
  }
  return pick(q.scalar_type(), k.scalar_type(), dim, q.size(1) / kv_heads);
}

// query [rows, heads, positions, dim]; key, value [rows, kv_heads, columns, dim] (any strides
// but the head dim's); mask [rows, 1, positions or 1, columns] bool (true attends) or None.
// Returns the attention [rows, positions, heads, dim], as transformers' SDPA does, or None for a
// call the kernel does not take.
std::optional<at::Tensor> decode_attention(const at::Tensor& query, const at::Tensor& key,
                                           const at::Tensor& value,
                                           const std::optional<at::Tensor>& mask, double scale) {
  const Run run = fits(query, key, value, mask);
  if (!run) return std::nullopt;
  const bool masked = mask.has_value() && mask->defined();
  Problem p{query.data_ptr(), key.data_ptr(), value.data_ptr(),
            masked ? mask->data_ptr<bool>() : nullptr, nullptr,
            key.size(1), key.size(2),
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), masked ? mask->stride(0) : 0,
            static_cast<float>(scale), query.size(2), query.stride(2),
            masked && mask->size(2) > 1 ? mask->stride(2) : 0};
  at::Tensor out =
      at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  p.out = out.data_ptr();
  run(p, key.size(0) * key.size(1) * query.size(2));
  return out;
}

bool instantiated(at::ScalarType dtype, int64_t dim, int64_t groups,
                  std::optional<at::ScalarType> kv_dtype) {
  return pick(dtype, kv_dtype.value_or(dtype), dim, groups) != nullptr;
}

std::string instruction_set() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#elif defined(__aarch64__)
  return "neon";
#else
  return "default";
#endif
}

}  // namespace

// Operators release Python's GIL while they run, so the server's other threads go on.
TORCH_LIBRARY(seqgate, m) {
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale)"
        " -> Tensor?");
  m.def("instantiated(ScalarType dtype, int dim, int groups, ScalarType? kv_dtype=None) -> bool",
        &instantiated);
  m.def("instruction_set() -> str", &instruction_set);
}

TORCH_LIBRARY_IMPL(seqgate, CPU, m) { m.impl("decode_attention", &decode_attention); }
