// Paged decode attention on the CPU in one call per decode group (built with lora_cpu.cpp by
// kernels/cpu_fused.py; inference/layers/attention.py calls it):
//
//   out[rows[i], h] = softmax(scale * q[rows[i], h] . K_i^T) V_i     over the context_lens[i]
//                                                                   positions of sequence i
//
// with K_i / V_i read in place from the paged cache [num_blocks, block_size, Hkv, D] through
// block_tables[i]: no gather into a padded buffer, no mask over the padding (what the torch path
// pays for, its index_select and a masked SDPA, most of a batch-64 decode step's attention).
//
// Work item: one (sequence, kv head) with its G = Hq / Hkv query heads, so each K and V row is
// read once for all of them. Positions run in chunks of CH: the chunk's scores, then an online
// softmax (running max and sum, the accumulator rescaled when the max grows), then the chunk's
// V rows added in. Everything in fp32, whatever the cache's dtype; the output rounded once.
// GCC vector types, lowered by -march=native to AVX-512 or AVX2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"
#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace loraplex_vec;

constexpr int CH = V;          // positions per chunk: one vector of scores per query head

// the sum of v's lanes, as a tree (a loop would chain V dependent adds)
inline float hsum(vf v) {
#if defined(__AVX512F__)
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
#else
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
#endif
  return v[0] + v[1];
}

// r[c] = the sum of d[c]'s lanes, for the CH = V vectors of a chunk: a transpose-and-add tree,
// each level halving the vectors (V - 1 shuffle pairs in all, not a tree per vector)
inline vf reduce_lanes(vf (&d)[CH]) {
#if defined(__AVX512F__)
  vf e[8], f[4], g[2];
  for (int i = 0; i < 8; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    f[i] = __builtin_shufflevector(e[2 * i], e[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(e[2 * i], e[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    g[i] = __builtin_shufflevector(f[2 * i], f[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(f[2 * i], f[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf e[4], f[2];
  for (int i = 0; i < 4; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    f[i] = __builtin_shufflevector(e[2 * i], e[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(e[2 * i], e[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(f[0], f[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(f[0], f[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

struct Shape {
  int64_t block_size, hkv, g, d, q_row, q_head, out_row, out_head, table_row;
  float scale;
};

// One (sequence, kv head): out_g = softmax over positions of scale * q_g . k_p, times v_p, for
// its G query heads. DV = D / V vectors per head row, a compile-time count so that a row's
// vectors stay in registers.
template <int DV, typename T>
void item(const Shape& s, const T* q, T* out, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx,
          int64_t h) {
  constexpr int D = DV * V;
  const int64_t G = s.g;
  alignas(64) float qs[MAX_G][D];
  alignas(64) float acc[MAX_G][D];
  float m[MAX_G], l[MAX_G];
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + (h * G + g) * s.q_head;
    for (int j = 0; j < D; ++j) qs[g][j] = to_f(qg[j]) * s.scale, acc[g][j] = 0.f;
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const int64_t row = s.hkv * D;  // elements between positions in a block
  alignas(64) float kb[CH][D];     // the chunk's k and v rows, widened to fp32 once
  alignas(64) float vb[CH][D];
  vf lane{};
  for (int c = 0; c < CH; ++c) lane[c] = static_cast<float>(c);
  for (int64_t p0 = 0; p0 < ctx; p0 += CH) {
    const int n = static_cast<int>(std::min<int64_t>(CH, ctx - p0));
    load_chunk<DV, CH>(kb, vb, k_cache, v_cache, table, s.block_size, row, h, p0, n, ctx);  // past n: zeros, masked below
    const vf past = vf{} + static_cast<float>(n);
    for (int64_t g = 0; g < G; ++g) {
      vf q[DV];
      for (int j = 0; j < DV; ++j) q[j] = load_v(qs[g] + j * V);
      vf dots[CH];  // per position, the lanes of q_g . k_c
      for (int c = 0; c < CH; ++c) {
        vf dot = q[0] * load_v(kb[c]);
        for (int j = 1; j < DV; ++j) dot += q[j] * load_v(kb[c] + j * V);
        dots[c] = dot;
      }
      vf sc = reduce_lanes(dots);
      sc = lane < past ? sc : vf{} - std::numeric_limits<float>::infinity();  // past n: weight 0
      float chunk_max = sc[0];
      for (int c = 1; c < n; ++c) chunk_max = std::max(chunk_max, sc[c]);
      // online softmax: the running max, the sums and accumulator rescaled when it grows
      const float m_new = std::max(m[g], chunk_max);
      const float rescale = std::exp(m[g] - m_new);  // 0 on the first chunk (m = -inf)
      const vf p = exp_nonpositive(sc - m_new);
      l[g] = l[g] * rescale + hsum(p);
      m[g] = m_new;
      vf a[DV];
      for (int j = 0; j < DV; ++j) a[j] = load_v(acc[g] + j * V) * rescale;
      for (int c = 0; c < n; ++c) {
        const float w = p[c];
        for (int j = 0; j < DV; ++j) a[j] += w * load_v(vb[c] + j * V);
      }
      for (int j = 0; j < DV; ++j) __builtin_memcpy(acc[g] + j * V, &a[j], sizeof(vf));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    T* og = out + (h * G + g) * s.out_head;
    const float inv = 1.f / l[g];
    for (int j = 0; j < D; ++j) og[j] = static_cast<T>(acc[g][j] * inv);
  }
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens, const Shape& s) {
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* cp = context_lens.data_ptr<int64_t>();
  const int64_t n = rows.size(0);
  at::parallel_for(0, n * s.hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t i = it / s.hkv, h = it % s.hkv;
      const T* qi = qp + rp[i] * s.q_row;
      T* oi = op + rp[i] * s.out_row;
      const int64_t* ti = tp + i * s.table_row;
      by_head_vectors(s.d / V, [&](auto dv) { item<decltype(dv)::value, T>(s, qi, oi, kp, vp, ti, cp[i], h); });
    }
  });
}

// Checks everything the loops rely on (the Python side checks too; this keeps a wrong call from
// reading or writing out of bounds).
Shape check(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  check_heads(out, q, k_cache, v_cache);
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "rows: contiguous int64 [n]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.size(0) == rows.size(0),
              "block_tables: contiguous int64 [n, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 && context_lens.is_contiguous() &&
                  context_lens.size(0) == rows.size(0),
              "context_lens: contiguous int64 [n]");
  const int64_t n = rows.size(0), nb = block_tables.size(1), bs = k_cache.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* cp = context_lens.data_ptr<int64_t>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < q.size(0), "row out of range");
    TORCH_CHECK(cp[i] >= 1 && cp[i] <= nb * bs, "context length outside 1..max_blocks * block_size");
    check_blocks(tp + i * nb, cp[i], bs, k_cache.size(0));
  }
  return Shape{bs, hkv, hq / hkv, d, q.stride(0), q.stride(1), out.stride(0), out.stride(1), nb,
               static_cast<float>(scale)};
}

}  // namespace

void loraplex_ops::paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                                          const at::Tensor& v_cache, const at::Tensor& rows,
                                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                                          double scale) {
  const Shape s = check(out, q, k_cache, v_cache, rows, block_tables, context_lens, scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      return run<float>(out, q, k_cache, v_cache, rows, block_tables, context_lens, s);
    case at::kBFloat16:
      return run<c10::BFloat16>(out, q, k_cache, v_cache, rows, block_tables, context_lens, s);
    case at::kHalf:
      return run<c10::Half>(out, q, k_cache, v_cache, rows, block_tables, context_lens, s);
    default:
      TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
}

TORCH_LIBRARY_FRAGMENT(loraplex_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, "
      "Tensor block_tables, Tensor context_lens, float scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &loraplex_ops::paged_decode_attention);
}
