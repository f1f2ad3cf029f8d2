// What the CPU kernels share: ATen's float vector, kept in registers.
//
// Written over at::vec::Vectorized<float>, whose implementation (AVX512, AVX2, NEON) the
// CPU_CAPABILITY_* macro the build defines picks (engine/kernels/native.py).

#pragma once

#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <tuple>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

// Runs the lambda with scalar_t as float or at::BFloat16 after `type`, the dtypes the kernels
// take (ATen's dispatch; any other dtype throws).
#define SEQGATE_DISPATCH_FLOAT_BF16(type, name, ...)          \
  AT_DISPATCH_SWITCH(type, name,                              \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace seqgate {

using Vec = at::vec::Vectorized<float>;
constexpr int kLanes = Vec::size();

// N vectors meant for registers. An array of Vectorized runs a constructor loop, which takes
// its address and so keeps GCC from holding it in registers; this runs no constructor.
template <int N>
struct Vecs {
  union { Vec v[N]; };
  Vecs() {}
  Vec& operator[](int i) { return v[i]; }
};

inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const at::BFloat16* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}
inline Vec load(const at::Half* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}

inline void store(float* p, const Vec& v) { v.store(p); }
inline void store(at::BFloat16* p, const Vec& v) {
  // Rounded to nearest even, as a .to(torch.bfloat16) does; only the first kLanes are stored.
  at::vec::convert_from_float<at::BFloat16>(v, v).store(p, kLanes);
}

// v rounded to T and back: where the model's forward stores a T.
template <typename T>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

// One head turned by the rotary embedding (llama_layers._rotate): x * cos + roll(x, half) *
// signed_sin, each product and the sum rounded to T. `from` may be `to`: both halves of a lane
// are read before either is written.
template <typename T, typename In>
inline void rotate_head(const In* from, T* to, const T* cos, const T* signed_sin, int64_t half) {
  for (int64_t j = 0; j < half; j += kLanes) {
    const Vec lo = load(from + j), hi = load(from + half + j);
    store(to + j, round_to<T>(lo * load(cos + j)) + round_to<T>(hi * load(signed_sin + j)));
    store(to + half + j, round_to<T>(hi * load(cos + half + j)) +
                             round_to<T>(lo * load(signed_sin + half + j)));
  }
}

// SiLU of g as ATen's kernel computes it: g / (1 + e^-g), with the same vectorised exp.
inline Vec silu(const Vec& g) { return g / (Vec(1.f) + g.neg().exp()); }

// Reads a row of D elements ahead into the cache.
template <typename T, int D, int Locality = 3>
inline void prefetch_row(const T* row) {
  for (int i = 0; i < D * static_cast<int>(sizeof(T)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + i, 0, Locality);
}

// Lane i of the result is the sum of v[i]'s lanes (v, kLanes vectors, is overwritten): each
// level adds neighbouring lanes, so a block's dot products need no horizontal sum each. On
// AVX2, ATen's deinterleave2 takes four lane-crossing shuffles a step; unpacking within lanes
// and crossing once at the end is faster, so that one step is written in intrinsics.
inline Vec sum_lanes(Vecs<kLanes>& v) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
    b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                       _mm256_permute2f128_ps(b[0], b[1], 0x31));
#else
  for (int n = kLanes; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i) {
      const auto [even, odd] = at::vec::deinterleave2(v[2 * i], v[2 * i + 1]);
      v[i] = even + odd;
    }
  return v[0];
#endif
}

}  // namespace seqgate
