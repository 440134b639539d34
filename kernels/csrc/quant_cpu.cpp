// Weight-only quantised products for the CPU's decode, llama.cpp's way (built with lora_cpu.cpp
// by kernels/cpu_fused.py; inference/layers/quantized.py calls them):
//
//   q4_linear   y[t, n] = sum_g  s[n,g] * sum_i q[n, 32g+i] * x[t, 32g+i]  +  m[n,g] * sum_i x[t, 32g+i]
//               w = s * q + m, q in 0..15: GGUF's Q4_1 as it is (Q4_0: m = -8 s)
//   q8_linear   y[t, n] = s[n] * sum_k q[n, k] * x[t, k]                     q in -127..127
//
// The activations are quantised first, per token and group of 32: x ~ d[t,g] * xq, xq int8,
// d = max|x| / 127 (as llama.cpp's Q8 activations), so each group's dot product is 32 integer
// multiply-adds: with AVX2, one vpmaddubsw (unsigned 4-bit or |int8| weights times signed int8
// activations, pairs summed into int16: at most 2 * 127 * 127, no saturation) and one vpmaddwd,
// then one fp32 multiply-add by the group's scales. torch's own CPU kernels for these weights
// (aten::_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) widen every weight to float instead;
// which of the two serves is the engine's measured choice (inference/layers/quant_plan.py).
//
// Layouts (inference/layers/quantized.py builds them):
//   q4: qs [N, K/2] uint8, group g of row n in bytes 16g..16g+15: byte j holds weight 32g+j in
//       its low nibble and weight 32g+16+j in its high nibble (GGUF's Q4 block order);
//       scales, mins [N, K/32] fp16 (GGUF's d and m as they are; a row's are widened to fp32
//       once per pass)
//   q8: qw [N, K] int8; scales [N] fp32
//
// Work: rows in parallel (at::parallel_for), each row's weights read once for up to TB tokens
// at a time (TB accumulators in registers), its groups unpacked once for all of them. Without
// AVX2 the same arithmetic runs as plain loops (correct, slow: the plan then keeps torch's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORAPLEX_QUANT_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int QK = 32;  // weights per group: GGUF's block
constexpr int TB = 4;   // tokens per pass over a row

using loraplex_vec::by_float_dtype;
using loraplex_vec::to_f;

// The activations of T tokens, quantised per group of 32: q [T, K] int8, d [T, K/32] (the
// scale), s [T, K/32] (d * the group's sum of q: what a row's mins multiply).
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

template <typename T>
void quantize_group(const T* x, int8_t* q, float* d, float* s) {
  float f[QK];
  float amax = 0.f;
  bool nan = false;
  for (int i = 0; i < QK; ++i) {
    f[i] = to_f(x[i]);
    nan |= f[i] != f[i];
    amax = std::max(amax, std::fabs(f[i]));
  }
  if (nan || !std::isfinite(amax)) {  // the group's products are NaN, as a float product's would be
    std::memset(q, 0, QK);
    *d = *s = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float scale = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
#if LORAPLEX_QUANT_AVX2
  __m256i v[4];
  for (int b = 0; b < 4; ++b)  // round to nearest even, as the scalar path's nearbyint
    v[b] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(f + 8 * b), _mm256_set1_ps(inv)));
  __m256i total = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  half = _mm_hadd_epi32(half, half);
  sum = _mm_cvtsi128_si32(_mm_hadd_epi32(half, half));
  // int32 -> int16 -> int8 packs interleave the 128-bit lanes; the permute puts them back in order
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
#else
  for (int i = 0; i < QK; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(f[i] * inv));
    sum += q[i];
  }
#endif
  *d = scale;
  *s = scale * static_cast<float>(sum);
}

template <typename T>
QuantX quantize(const at::Tensor& x) {
  const int64_t T_ = x.size(0), K = x.size(1), G = K / QK;
  QuantX out{std::vector<int8_t>(T_ * K), std::vector<float>(T_ * G), std::vector<float>(T_ * G)};
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, T_ * G, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_group(xp + (i / G) * K + (i % G) * QK, &out.q[i * QK], &out.d[i], &out.s[i]);
  });
  return out;
}

#if LORAPLEX_QUANT_AVX2
// the sum of v's 8 lanes
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

inline float dot_f32(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
#if LORAPLEX_QUANT_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  sum = hsum(acc);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#if LORAPLEX_QUANT_AVX2

// 32 unsigned times 32 signed bytes -> 8 fp32 partial sums of their products
inline __m256 dot_us8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// group g of a Q4 row: 16 bytes -> 32 values 0..15 (low nibbles, then high)
inline __m256i unpack_q4(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// sums[j] = the sum over a row's G groups of what group(g, acc) adds into acc[j] for token j.
// Groups go in pairs into two sets of accumulators, so one token's fp32 adds do not wait on each
// other (named variables: an array indexed by the group's parity would live on the stack).
template <int NT, typename Group>
inline void sum_groups(int64_t G, Group group, float* sums) {
  __m256 even[NT], odd[NT];
  for (int j = 0; j < NT; ++j) even[j] = odd[j] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 1 < G; g += 2) {
    group(g, even);
    group(g + 1, odd);
  }
  if (g < G) group(g, even);
  for (int j = 0; j < NT; ++j) sums[j] = hsum(_mm256_add_ps(even[j], odd[j]));
}

// Row n for NT tokens: out[j] = sum_g (s[g] * d[j,g]) * dot(q_g, xq[j]_g) + the mins' term
template <int NT>
void q4_row(const uint8_t* qs, const float* sc, const float* mn, int64_t G, int64_t K, const QuantX& x, int64_t t0,
            float* out) {
  const int8_t* xq = x.q.data() + t0 * K;
  const float* xd = x.d.data() + t0 * G;
  auto group = [&](int64_t g, __m256* acc) {
    const __m256i w = unpack_q4(qs + g * (QK / 2));
    for (int j = 0; j < NT; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * K + g * QK));
      acc[j] = _mm256_fmadd_ps(dot_us8(w, xv), _mm256_set1_ps(sc[g] * xd[j * G + g]), acc[j]);
    }
  };
  sum_groups<NT>(G, group, out);
  for (int j = 0; j < NT; ++j) out[j] += dot_f32(mn, &x.s[(t0 + j) * G], G);
}

template <int NT>
void q8_row(const int8_t* qw, float scale, int64_t G, int64_t K, const QuantX& x, int64_t t0, float* out) {
  const int8_t* xq = x.q.data() + t0 * K;
  const float* xd = x.d.data() + t0 * G;
  auto group = [&](int64_t g, __m256* acc) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * QK));
    const __m256i magnitude = _mm256_sign_epi8(w, w);  // |w|, unsigned for vpmaddubsw
    for (int j = 0; j < NT; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * K + g * QK));
      // x carries w's sign (and is 0 where w is), so |w| * x' = w * x
      acc[j] = _mm256_fmadd_ps(dot_us8(magnitude, _mm256_sign_epi8(xv, w)), _mm256_set1_ps(xd[j * G + g]), acc[j]);
    }
  };
  sum_groups<NT>(G, group, out);
  for (int j = 0; j < NT; ++j) out[j] *= scale;
}
#else
template <int NT>
void q4_row(const uint8_t* qs, const float* sc, const float* mn, int64_t G, int64_t K, const QuantX& x, int64_t t0,
            float* out) {
  for (int j = 0; j < NT; ++j) {
    const int64_t t = t0 + j;
    float sum = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      int32_t dot = 0;
      for (int i = 0; i < QK / 2; ++i) {
        const uint8_t b = qs[g * (QK / 2) + i];
        dot += (b & 0x0F) * x.q[t * K + g * QK + i] + (b >> 4) * x.q[t * K + g * QK + QK / 2 + i];
      }
      sum += sc[g] * x.d[t * G + g] * static_cast<float>(dot);
    }
    out[j] = sum + dot_f32(mn, &x.s[t * G], G);
  }
}

template <int NT>
void q8_row(const int8_t* qw, float scale, int64_t G, int64_t K, const QuantX& x, int64_t t0, float* out) {
  for (int j = 0; j < NT; ++j) {
    const int64_t t = t0 + j;
    float sum = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      int32_t dot = 0;
      for (int i = 0; i < QK; ++i) dot += qw[g * QK + i] * x.q[t * K + g * QK + i];
      sum += x.d[t * G + g] * static_cast<float>(dot);
    }
    out[j] = scale * sum;
  }
}
#endif

// y [T, N] in x's dtype; row(n, t0, nt, float* out[nt]) computes row n for tokens t0..t0+nt-1
template <typename T, typename Row>
at::Tensor run_rows(const at::Tensor& x, int64_t N, Row row) {
  const int64_t T_ = x.size(0);
  at::Tensor y = at::empty({T_, N}, x.options());
  T* yp = y.data_ptr<T>();
  // ~a row's weights per unit: enough rows a chunk that threads do not fight over cache lines
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float out[TB];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t t0 = 0; t0 < T_; t0 += TB) {
        const int64_t nt = std::min<int64_t>(TB, T_ - t0);
        row(n, t0, nt, out);
        for (int64_t j = 0; j < nt; ++j) yp[(t0 + j) * N + n] = static_cast<T>(out[j]);
      }
    }
  });
  return y;
}

// calls f<NT>(...) with the compile-time token count for nt in 1..TB
template <typename F>
inline void by_count(int64_t nt, F f) {
  switch (nt) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2, "x must be a [T, in] tensor, got ", x.dim(), " dimensions");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight takes ", K);
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of ", QK);
}

// a row's fp16 scales (or mins) widened to fp32
void widen(const c10::Half* h, float* f, int64_t n) {
  int64_t i = 0;
#if LORAPLEX_QUANT_AVX2 && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) f[i] = static_cast<float>(h[i]);
}

}  // namespace

at::Tensor loraplex_ops::q4_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& scales,
                                   const at::Tensor& mins) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous(), "qs must be contiguous uint8 [out, in/2]");
  const int64_t N = qs.size(0), K = qs.size(1) * 2, G = K / QK;
  check_x(x_in, K);
  const at::Tensor x = x_in.contiguous();
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G, "scales and mins must be contiguous fp16 [out, in/32]");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const c10::Half* mp = mins.data_ptr<c10::Half>();
  return by_float_dtype(x.scalar_type(), "quantised linear", [&](auto tag) {
    using T = decltype(tag);
    const QuantX xq = quantize<T>(x);
    return run_rows<T>(x, N, [&](int64_t n, int64_t t0, int64_t nt, float* out) {
      thread_local std::vector<float> row;  // the row's scales, then its mins, in fp32
      row.resize(2 * G);
      widen(sp + n * G, row.data(), G);
      widen(mp + n * G, row.data() + G, G);
      by_count(nt, [&](auto c) { q4_row<decltype(c)::value>(qp + n * (K / 2), row.data(), row.data() + G, G, K, xq, t0, out); });
    });
  });
}

at::Tensor loraplex_ops::q8_linear(const at::Tensor& x_in, const at::Tensor& qw, const at::Tensor& scales) {
  TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kChar && qw.is_contiguous(), "qw must be contiguous int8 [out, in]");
  const int64_t N = qw.size(0), K = qw.size(1), G = K / QK;
  check_x(x_in, K);
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1 && scales.size(0) == N,
              "scales must be contiguous fp32 [out]");
  const int8_t* qp = qw.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return by_float_dtype(x.scalar_type(), "quantised linear", [&](auto tag) {
    using T = decltype(tag);
    const QuantX xq = quantize<T>(x);
    return run_rows<T>(x, N, [&](int64_t n, int64_t t0, int64_t nt, float* out) {
      by_count(nt, [&](auto c) { q8_row<decltype(c)::value>(qp + n * K, sp[n], G, K, xq, t0, out); });
    });
  });
}

TORCH_LIBRARY_FRAGMENT(loraplex_cpu, m) {
  m.def("q4_linear(Tensor x, Tensor qs, Tensor scales, Tensor mins) -> Tensor");
  m.impl("q4_linear", c10::DispatchKey::CPU, &loraplex_ops::q4_linear);
  m.def("q8_linear(Tensor x, Tensor qw, Tensor scales) -> Tensor");
  m.impl("q8_linear", c10::DispatchKey::CPU, &loraplex_ops::q8_linear);
}
