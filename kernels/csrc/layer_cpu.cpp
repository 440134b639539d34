// A decoder layer's small ops on the CPU, one call each instead of torch's chains (built with
// lora_cpu.cpp by kernels/cpu_fused.py; inference/layers/norm.py and rotary.py call them):
//
//   rms_norm(x, w, eps)            HF's LlamaRMSNorm: w * round(x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x, d, w, eps)     (s, rms_norm(s, w, eps)) with s = round(x + d): the residual add
//                                  and the next norm
//   rope(qkv, cos, sin, heads)     the first `heads` heads of qkv [T, H, D] rotated (HF's
//                                  rotate_half pairs i with i + D/2), as a new [T, heads, D]
//   silu_mul(gate_up)              round(round(silu(gate)) * up) [T, I] of gate_up [T, 2I] = [gate | up]:
//                                  the MLP's activation in one pass (torch: silu over the gate
//                                  half, then the product, each a pass over [T, I] through memory;
//                                  ~0.7 ms each for a 1750-token prefill of SmolLM2 on a 2-core EPYC)
//
// At one decode token a layer's RMSNorm is 8 torch ops and RoPE 6, each a few microseconds of
// dispatch for 576 numbers (35-55 us a norm on a 2-core AMD EPYC, 61 norms a token): at batch 1
// that, not arithmetic, is what they cost. The results are torch's to the rounding: every step
// that torch rounds to the activations' dtype (bf16, fp16) is rounded here at the same point,
// the arithmetic in fp32 between; only the order of the sum of squares differs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using namespace loraplex_vec;

template <typename T>
inline float rounded(float v) {  // v as torch leaves it in a T tensor
  return to_f(static_cast<T>(v));
}

// rows per parallel chunk: ~16k elements, so a decode token's rows run inline on the caller
inline int64_t grain(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)); }

template <typename T, typename W, typename O>
void norm_row(const T* x, const W* w, O* out, int64_t d, float eps) {
  vf acc = {};
  int64_t i = 0;
  for (; i + V <= d; i += V) {
    const vf v = load_v(x + i);
    acc += v * v;
  }
  float ss = 0.f;
  for (int j = 0; j < V; ++j) ss += acc[j];
  for (; i < d; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (i = 0; i < d; ++i) out[i] = static_cast<O>(to_f(w[i]) * rounded<T>(to_f(x[i]) * r));
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": x must be a contiguous [T, dim] tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), what, ": weight must be [", x.size(1),
              "], got ", w.sizes());
}

// out[t] = norm(src[t]) for every row, in parallel
template <typename T>
void norm_rows(const at::Tensor& src, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t rows = src.size(0), d = src.size(1);
  const T* sp = src.data_ptr<T>();
  by_float_dtype(w.scalar_type(), "rms_norm", [&](auto wtag) {
    using W = decltype(wtag);
    by_float_dtype(out.scalar_type(), "rms_norm", [&](auto otag) {
      using O = decltype(otag);
      const W* wp = w.data_ptr<W>();
      O* op = out.data_ptr<O>();
      at::parallel_for(0, rows, grain(d), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) norm_row(sp + t * d, wp, op + t * d, d, static_cast<float>(eps));
      });
    });
  });
}

}  // namespace

at::Tensor loraplex_ops::rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  const at::Tensor x = x_in.contiguous();
  check_rows(x, w, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::result_type(w, x)));
  by_float_dtype(x.scalar_type(), "rms_norm", [&](auto tag) { norm_rows<decltype(tag)>(x, w, out, eps); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> loraplex_ops::add_rms_norm(const at::Tensor& x_in, const at::Tensor& d_in,
                                                              const at::Tensor& w, double eps) {
  const at::Tensor x = x_in.contiguous(), delta = d_in.contiguous();
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: the added tensor must match x (", x.sizes(), " ", x.scalar_type(), "), got ",
              delta.sizes(), " ", delta.scalar_type());
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::result_type(w, x)));
  by_float_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const int64_t rows = x.size(0), d = x.size(1);
    const T* xp = x.data_ptr<T>();
    const T* dp = delta.data_ptr<T>();
    T* sp = sum.data_ptr<T>();
    at::parallel_for(0, rows * d, grain(1), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sp[i] = static_cast<T>(to_f(xp[i]) + to_f(dp[i]));
    });
    norm_rows<T>(sum, w, out, eps);
  });
  return {sum, out};
}

at::Tensor loraplex_ops::rope(const at::Tensor& qkv, const at::Tensor& cos_in, const at::Tensor& sin_in,
                              int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1, "rope: qkv must be [T, H, D] with D contiguous");
  const int64_t T_ = qkv.size(0), D = qkv.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rope: head size must be even, got ", D);
  TORCH_CHECK(heads >= 0 && heads <= qkv.size(1), "rope: heads must be in 0..", qkv.size(1), ", got ", heads);
  const at::Tensor cos = cos_in.reshape({-1, D}).contiguous(), sin = sin_in.reshape({-1, D}).contiguous();
  TORCH_CHECK(cos.size(0) == T_ && sin.size(0) == T_ && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rope: cos and sin must be [T, 1, D] in qkv's dtype");
  at::Tensor out = at::empty({T_, heads, D}, qkv.options());
  by_float_dtype(qkv.scalar_type(), "rope", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t st = qkv.stride(0), sh = qkv.stride(1);
    at::parallel_for(0, T_ * heads, grain(D), [&](int64_t b, int64_t e) {
      for (int64_t item = b; item < e; ++item) {
        const int64_t t = item / heads, h = item % heads;
        const T* x = xp + t * st + h * sh;
        const T* c = cp + t * D;
        const T* s = sp + t * D;
        T* o = op + item * D;
        // torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T; the two
        // halves as separate loops (no branch in them: the compiler vectorises them)
        for (int64_t i = 0; i < half; ++i)
          o[i] = static_cast<T>(rounded<T>(to_f(x[i]) * to_f(c[i])) + rounded<T>(-to_f(x[i + half]) * to_f(s[i])));
        for (int64_t i = half; i < D; ++i)
          o[i] = static_cast<T>(rounded<T>(to_f(x[i]) * to_f(c[i])) + rounded<T>(to_f(x[i - half]) * to_f(s[i])));
      }
    });
  });
  return out;
}

namespace {

// silu(x) = x / (1 + exp(-x)), with e = exp(-|x|) <= 1 so the exp never overflows:
// x >= 0: x / (1 + e); x < 0: x * e / (1 + e)
inline vf silu(vf x) {
  const vf neg_abs = x < 0.f ? x : -x;
  const vf e = exp_nonpositive(neg_abs);
  return (x < 0.f ? x * e : x) / (1.f + e);
}

template <typename T>
inline void silu_mul_vec(const T* gate, const T* up, T* out) {  // V elements, each rounded as torch rounds
  const vf s = silu(load_v(gate));
  vf s_rounded;
  for (int j = 0; j < V; ++j) s_rounded[j] = rounded<T>(s[j]);
  const vf prod = s_rounded * load_v(up);
  for (int j = 0; j < V; ++j) out[j] = static_cast<T>(prod[j]);
}

template <>
inline void silu_mul_vec<float>(const float* gate, const float* up, float* out) {
  const vf prod = silu(load_v(gate)) * load_v(up);
  __builtin_memcpy(out, &prod, sizeof(vf));
}

template <>
inline void silu_mul_vec<c10::BFloat16>(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out) {
  // silu rounded to bf16 and widened back (a bf16 is fp32's top half), times up, rounded again
  const vu s_bits = __builtin_convertvector(round_bf16(silu(load_v(gate))), vu) << 16;
  vf s;
  __builtin_memcpy(&s, &s_bits, sizeof(vf));
  const vh out_bits = round_bf16(s * load_v(up));
  __builtin_memcpy(out, &out_bits, sizeof(vh));
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + V <= n; i += V) silu_mul_vec<T>(gate + i, up + i, out + i);
  if (i < n) {  // the tail through a padded copy
    T g[V] = {}, u[V] = {}, o[V];
    for (int64_t j = i; j < n; ++j) g[j - i] = gate[j], u[j - i] = up[j];
    silu_mul_vec<T>(g, u, o);
    for (int64_t j = i; j < n; ++j) out[j] = o[j - i];
  }
}

}  // namespace

at::Tensor loraplex_ops::silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [T, 2I] with rows contiguous");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  by_float_dtype(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(inter), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) silu_mul_row<T>(xp + t * stride, xp + t * stride + inter, op + t * inter, inter);
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(loraplex_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &loraplex_ops::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &loraplex_ops::add_rms_norm);
  m.def("rope(Tensor qkv, Tensor cos, Tensor sin, int heads) -> Tensor");
  m.impl("rope", c10::DispatchKey::CPU, &loraplex_ops::rope);
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &loraplex_ops::silu_mul);
}
