// Paged prefill attention on the CPU: every prefill chunk of a step in one call (built with the
// other kernels by kernels/cpu_fused.py; inference/layers/attention.py calls it):
//
//   out[starts[i] + j, h] = softmax(scale * q[starts[i] + j, h] . K_i^T) V_i   over positions
//                           0 .. first_i + j,  first_i = context_lens[i] - query_lens[i]
//
// with K_i / V_i read in place from the paged cache [num_blocks, block_size, Hkv, D] through
// block_tables[i] (the chunk's own k/v are written there first), so a chunk after a cached
// prefix needs no gather and no mask tensor. torch's SDPA takes one call per sequence per
// layer: for a step of 32 prompts of 20-200 tokens that was ~10 ms a layer on a 2-core EPYC,
// ~50 GFLOP/s, mostly per-call cost.
//
// The layout is chosen so that the inner loops are only multiply-adds, with no reductions across
// lanes: a tile is V query vectors of one (sequence, kv head), u = j * G + g (query row j of the
// chunk, its head h * G + g), one per lane. Per chunk of CH = V positions:
//   scores  sc[c] (lanes: the tile's query vectors) = sum over d of qt[d] * k[c][d]: the scaled q
//           transposed once per tile, each k element broadcast;
//   softmax the running max and sum per lane (an online softmax; the accumulator rescaled when
//           the max grows), positions past a row's own masked out;
//   values  acc[d] += p[c] * v[c][d], the accumulator transposed alike.
// A tile stops at its last row's position (causal: no chunk is read that no row attends).
// Everything in fp32 whatever the cache's dtype; the output rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"
#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace loraplex_vec;

constexpr int CH = V;          // positions per chunk

struct Shape {
  int64_t block_size, hkv, g, q_row, out_row, table_row;
  float scale;
};

struct Item {  // one tile: sequence i, kv head h, query vectors u0 .. u0 + V - 1
  int64_t i, h, u0, cost;
};

template <int DV, typename T>
void tile(const Shape& s, const T* q, T* out, const T* k_cache, const T* v_cache, const int64_t* table,
          int64_t q_len, int64_t ctx, int64_t h, int64_t u0) {
  constexpr int D = DV * V;
  const int64_t G = s.g, first = ctx - q_len;  // absolute position of the chunk's row 0
  const int64_t lanes = std::min<int64_t>(V, q_len * G - u0);
  const int64_t p_lo = first + u0 / G, p_hi = first + (u0 + lanes - 1) / G;
  alignas(64) float qt[D][V];   // scale * q, transposed: [d][lane]
  alignas(64) float acc[D][V];  // the weighted sum of v rows, transposed alike
  vf pos;                       // per lane, the absolute position of its row
  for (int lane = 0; lane < V; ++lane) {
    if (lane < lanes) {
      const int64_t u = u0 + lane, j = u / G, g = u % G;
      const T* qv = q + j * s.q_row + (h * G + g) * D;
      for (int d = 0; d < D; ++d) qt[d][lane] = to_f(qv[d]) * s.scale;
      pos[lane] = static_cast<float>(first + j);
    } else {  // idle: zero scores over the tile's range, never written out
      for (int d = 0; d < D; ++d) qt[d][lane] = 0.f;
      pos[lane] = static_cast<float>(p_hi);
    }
  }
  for (int d = 0; d < D; ++d) {
    const vf zero{};
    __builtin_memcpy(acc[d], &zero, sizeof(vf));
  }
  vf m = vf{} - std::numeric_limits<float>::infinity(), l{};
  const int64_t row = s.hkv * D;  // elements between positions in a block
  alignas(64) float kb[CH][D];     // the chunk's k and v rows, widened to fp32 once
  alignas(64) float vb[CH][D];
  for (int64_t p0 = 0; p0 <= p_hi; p0 += CH) {
    const int n = static_cast<int>(std::min<int64_t>(CH, p_hi + 1 - p0));
    load_chunk<DV, CH>(kb, vb, k_cache, v_cache, table, s.block_size, row, h, p0, n, p_hi + 1);  // past n: zeros, masked below
    vf sc[CH];
    for (int c = 0; c < CH; ++c) sc[c] = vf{};
    for (int d = 0; d < D; ++d) {
      const vf qd = load_v(qt[d]);
      for (int c = 0; c < CH; ++c) sc[c] += qd * kb[c][d];
    }
    if (p0 + CH - 1 > p_lo) {  // some lane's row ends inside this chunk: hide what follows it
      const vf ninf = vf{} - std::numeric_limits<float>::infinity();
      for (int c = 0; c < CH; ++c) sc[c] = pos >= static_cast<float>(p0 + c) ? sc[c] : ninf;
    }
    vf mx = m;
    for (int c = 0; c < CH; ++c) mx = sc[c] > mx ? sc[c] : mx;
    const vf rescale = exp_nonpositive(m - mx);  // 0 on the first chunk (m = -inf)
    m = mx;
    vf sum{};
    for (int c = 0; c < CH; ++c) {
      sc[c] = exp_nonpositive(sc[c] - mx);
      sum += sc[c];
    }
    l = l * rescale + sum;
    for (int d = 0; d < D; ++d) {
      vf a = load_v(acc[d]) * rescale;
      for (int c = 0; c < CH; ++c) a += sc[c] * vb[c][d];
      __builtin_memcpy(acc[d], &a, sizeof(vf));
    }
  }
  for (int lane = 0; lane < lanes; ++lane) {
    const int64_t u = u0 + lane, j = u / G, g = u % G;
    T* ov = out + j * s.out_row + (h * G + g) * D;
    const float inv = 1.f / l[lane];
    for (int d = 0; d < D; ++d) ov[d] = static_cast<T>(acc[d][lane] * inv);
  }
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& starts, const at::Tensor& query_lens, const at::Tensor& block_tables,
         const at::Tensor& context_lens, const Shape& s, int64_t d) {
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* qlp = query_lens.data_ptr<int64_t>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* cp = context_lens.data_ptr<int64_t>();
  // Tiles, costliest first (cost: the positions read), handed out one at a time: the causal
  // tiles of a long prompt differ in cost up to its length, so a static split would idle a core.
  std::vector<Item> items;
  for (int64_t i = 0; i < starts.size(0); ++i)
    for (int64_t h = 0; h < s.hkv; ++h)
      for (int64_t u0 = 0; u0 < qlp[i] * s.g; u0 += V)
        items.push_back({i, h, u0, cp[i] - qlp[i] + std::min(u0 + V - 1, qlp[i] * s.g - 1) / s.g + 1});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (size_t it = next.fetch_add(1); it < items.size(); it = next.fetch_add(1)) {
        const Item& t = items[it];
        const T* qi = qp + sp[t.i] * s.q_row;
        T* oi = op + sp[t.i] * s.out_row;
        const int64_t* ti = tp + t.i * s.table_row;
        by_head_vectors(d / V, [&](auto dv) {
          tile<decltype(dv)::value, T>(s, qi, oi, kp, vp, ti, qlp[t.i], cp[t.i], t.h, t.u0);
        });
      }
    }
  });
}

// Checks everything the loops rely on (the Python side builds these tensors; this keeps a wrong
// call from reading or writing out of bounds).
Shape check(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& starts, const at::Tensor& query_lens, const at::Tensor& block_tables,
            const at::Tensor& context_lens, double scale) {
  check_heads(out, q, k_cache, v_cache);
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  for (const auto* t : {&starts, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() && t->size(0) == starts.size(0),
                "starts, query_lens and context_lens: contiguous int64 [n] alike");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.size(0) == starts.size(0),
              "block_tables: contiguous int64 [n, max_blocks]");
  const int64_t n = starts.size(0), nb = block_tables.size(1), bs = k_cache.size(1);
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* qlp = query_lens.data_ptr<int64_t>();
  const int64_t* cp = context_lens.data_ptr<int64_t>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(qlp[i] >= 1 && sp[i] >= 0 && sp[i] + qlp[i] <= q.size(0), "a chunk's rows fall outside q");
    TORCH_CHECK(cp[i] >= qlp[i] && cp[i] <= nb * bs, "context length outside query_len..max_blocks * block_size");
    check_blocks(tp + i * nb, cp[i], bs, k_cache.size(0));
  }
  return Shape{bs, hkv, hq / hkv, q.stride(0), out.stride(0), nb, static_cast<float>(scale)};
}

}  // namespace

void loraplex_ops::paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& starts,
                                           const at::Tensor& query_lens, const at::Tensor& block_tables,
                                           const at::Tensor& context_lens, double scale) {
  const Shape s = check(out, q, k_cache, v_cache, starts, query_lens, block_tables, context_lens, scale);
  by_float_dtype(q.scalar_type(), "paged_prefill_attention", [&](auto zero) {
    using T = decltype(zero);
    run<T>(out, q, k_cache, v_cache, starts, query_lens, block_tables, context_lens, s, q.size(2));
  });
}

TORCH_LIBRARY_FRAGMENT(loraplex_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor starts, "
      "Tensor query_lens, Tensor block_tables, Tensor context_lens, float scale) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &loraplex_ops::paged_prefill_attention);
}
