// What the CPU kernels (lora_cpu.cpp, attention_cpu.cpp, ...) share: one register of floats as a
// GCC vector type, lowered by -march=native to AVX-512 (16 floats) or AVX2 (8), and loading V
// values of any of the model's dtypes into it as fp32, and rounding fp32 to bf16 as c10 does; the
// softmax's exp; and the dispatch on those dtypes.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace loraplex_vec {

#if defined(__AVX512F__)
constexpr int V = 16;
#else
constexpr int V = 8;
#endif
typedef float vf __attribute__((vector_size(V * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(V * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(V * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(V * sizeof(uint16_t))));

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline vf load_v(const T* p) {
  vf v;
  for (int i = 0; i < V; ++i) v[i] = to_f(p[i]);
  return v;
}

template <>
inline vf load_v<float>(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(vf));
  return v;
}

template <>
inline vf load_v<c10::BFloat16>(const c10::BFloat16* p) {  // bf16 is fp32's top half
  vh raw;
  __builtin_memcpy(&raw, p, sizeof(vh));
  vu bits = __builtin_convertvector(raw, vu) << 16;
  vf v;
  __builtin_memcpy(&v, &bits, sizeof(vf));
  return v;
}

// fp32 -> bf16, round to nearest even, NaN stays NaN (as c10::BFloat16 rounds one value)
inline vh round_bf16(vf v) {
  vu bits;
  __builtin_memcpy(&bits, &v, sizeof(vu));
  vu rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  vu nan = (vu)(v != v);  // all ones where NaN
  rounded = (rounded & ~nan) | (0x7fc0u & nan);
  return __builtin_convertvector(rounded, vh);
}

// exp(x) for x <= 0 (a score minus the running max), relative error ~2e-7: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, 2^n put in the exponent bits.
// Below -87 the result is 0 (what expf gives, to within a denormal).
inline vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.f;
  x = x < lo ? lo : x;
  const vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + (vf{} - 0.5f), vi), vf);
  // the conversion truncates toward zero; x * log2(e) - 0.5 is negative, so this rounds to nearest
  const vf r = x - n * 0.693147180559945309f;
  vf p = vf{} + (1.f / 720.f);
  p = p * r + (1.f / 120.f);
  p = p * r + (1.f / 24.f);
  p = p * r + (1.f / 6.f);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof(vf));
  vf out = p * scale;
  return x <= lo ? vf{} : out;
}

// f(T{}) with T the C++ type of `t` (fp32, bf16, fp16); anything else: an error naming `what`
template <typename F>
inline auto by_float_dtype(c10::ScalarType t, const char* what, F f) -> decltype(f(float{})) {
  switch (t) {
    case c10::ScalarType::Float: return f(float{});
    case c10::ScalarType::BFloat16: return f(c10::BFloat16{});
    case c10::ScalarType::Half: return f(c10::Half{});
    default: TORCH_CHECK(false, what, ": unsupported dtype ", t);
  }
}

}  // namespace loraplex_vec
