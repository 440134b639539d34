// One adapter's rows into and out of a slot of paired stacks (kernels/cpu_stacks.py), one call
// per projection. Paired stacks keep each pair of rows interleaved, so a slot write is a
// transpose (A) or an interleave (B) of every slice; done with torch ops it took ~20 small ops a
// slice (views, strided copies, zeroing), ~40 us each, 9 ms for a SmolLM2 adapter's 210 slices
// on the step thread, on a cold adapter's first token (2-core Intel Xeon), and as long again
// to copy an evicted one out. Here each is one pass over the slot.
//
//   write_paired_slot(a_t, b_t, slot, a, b)   slot := the adapter's rows, zero past each rank
//       a_t  [L, in/2, 2*R*S] bf16 (pair row k, element 2(r*S + s) + p: row r of A_s, column 2k+p)
//       b_t  S x [L, R/2, 2*n_s] bf16 (pair row q, element 2j + p: B_s[j, 2q + p])
//       a    S x [r_s, in] bf16 contiguous (r_s = 0: slice s all zero), b  S x [n_s, r_s]
//   read_paired_slot(a_t, b_t, slot, rank, a, b)   a[s] [rank, in], b[s] [n_s, rank] := the slot's rows
//
// A pair of bf16 is moved as one 32-bit word where it stays a pair (A's columns 2k, 2k+1).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "ops.h"

#include <cstdint>
#include <vector>

namespace {

struct Layout {
  int64_t S, R, in2, slot;
  std::vector<int64_t> widths;  // n_s
};

Layout check(const at::Tensor& a_t, const std::vector<at::Tensor>& b_t, int64_t slot) {
  TORCH_CHECK(a_t.device().is_cpu() && a_t.scalar_type() == at::kBFloat16 && a_t.dim() == 3 && a_t.is_contiguous(),
              "a_t: contiguous bf16 [L, in/2, 2*R*S] on the CPU expected");
  const int64_t S = static_cast<int64_t>(b_t.size());
  TORCH_CHECK(S >= 1 && a_t.size(2) % (2 * S) == 0, "a_t's columns must be 2 * max_rank * len(b_t)");
  Layout l{S, a_t.size(2) / (2 * S), a_t.size(1), slot, {}};
  TORCH_CHECK(l.R % 2 == 0, "paired stacks need an even max_rank");
  TORCH_CHECK(slot >= 0 && slot < a_t.size(0), "slot out of range");
  for (const auto& b : b_t) {
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kBFloat16 && b.dim() == 3 && b.is_contiguous() &&
                    b.size(0) == a_t.size(0) && b.size(1) * 2 == l.R && b.size(2) % 2 == 0,
                "each b_t must be contiguous bf16 [L, max_rank/2, 2*n_s]");
    l.widths.push_back(b.size(2) / 2);
  }
  return l;
}

void check_rows(const Layout& l, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, bool same_rank) {
  TORCH_CHECK(static_cast<int64_t>(a.size()) == l.S && static_cast<int64_t>(b.size()) == l.S, "one A and one B per slice");
  for (int64_t s = 0; s < l.S; ++s) {
    TORCH_CHECK(a[s].device().is_cpu() && b[s].device().is_cpu(), "CPU tensors only");
    TORCH_CHECK(a[s].scalar_type() == at::kBFloat16 && a[s].dim() == 2 && a[s].is_contiguous() &&
                    a[s].size(1) == 2 * l.in2 && a[s].size(0) <= l.R,
                "each A must be contiguous bf16 [rank <= max_rank, in]");
    TORCH_CHECK(b[s].scalar_type() == at::kBFloat16 && b[s].dim() == 2 && b[s].is_contiguous() &&
                    b[s].size(0) == l.widths[s] && b[s].size(1) == a[s].size(0),
                "each B must be contiguous bf16 [n_s, its A's rank]");
    TORCH_CHECK(!same_rank || a[s].size(0) == a[0].size(0), "one rank for every slice");
  }
}

}  // namespace

void loraplex_ops::write_paired_slot(at::Tensor a_t, std::vector<at::Tensor> b_t, int64_t slot,
                                     std::vector<at::Tensor> a, std::vector<at::Tensor> b) {
  const Layout l = check(a_t, b_t, slot);
  check_rows(l, a, b, false);
  const int64_t cols = l.R * l.S;  // 32-bit words in a pair row of a_t
  uint32_t* dst = reinterpret_cast<uint32_t*>(a_t.data_ptr()) + slot * l.in2 * cols;
  std::vector<const uint32_t*> src(l.S);
  std::vector<int64_t> rank(l.S);
  for (int64_t s = 0; s < l.S; ++s) {
    src[s] = reinterpret_cast<const uint32_t*>(a[s].data_ptr());
    rank[s] = a[s].size(0);
  }
  for (int64_t k = 0; k < l.in2; ++k, dst += cols)
    for (int64_t r = 0; r < l.R; ++r)
      for (int64_t s = 0; s < l.S; ++s) dst[r * l.S + s] = r < rank[s] ? src[s][r * l.in2 + k] : 0u;
  for (int64_t s = 0; s < l.S; ++s) {
    const int64_t n = l.widths[s], r_s = rank[s];
    uint16_t* bt = reinterpret_cast<uint16_t*>(b_t[s].data_ptr()) + slot * (l.R / 2) * 2 * n;
    const uint16_t* bs = reinterpret_cast<const uint16_t*>(b[s].data_ptr());
    for (int64_t q = 0; q < l.R / 2; ++q, bt += 2 * n)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < 2; ++p) bt[2 * j + p] = 2 * q + p < r_s ? bs[j * r_s + 2 * q + p] : uint16_t{0};
  }
}

void loraplex_ops::read_paired_slot(const at::Tensor& a_t, const std::vector<at::Tensor>& b_t, int64_t slot,
                                    int64_t rank, std::vector<at::Tensor> a, std::vector<at::Tensor> b) {
  const Layout l = check(a_t, b_t, slot);
  check_rows(l, a, b, true);
  TORCH_CHECK(rank >= 1 && rank <= l.R && a[0].size(0) == rank, "rank out of range, or not the outputs' rank");
  const int64_t cols = l.R * l.S;
  const uint32_t* from = reinterpret_cast<const uint32_t*>(a_t.data_ptr()) + slot * l.in2 * cols;
  for (int64_t s = 0; s < l.S; ++s) {
    uint32_t* out = reinterpret_cast<uint32_t*>(a[s].data_ptr());
    for (int64_t r = 0; r < rank; ++r)
      for (int64_t k = 0; k < l.in2; ++k) out[r * l.in2 + k] = from[k * cols + r * l.S + s];
    const int64_t n = l.widths[s];
    const uint16_t* bt = reinterpret_cast<const uint16_t*>(b_t[s].data_ptr()) + slot * (l.R / 2) * 2 * n;
    uint16_t* bs = reinterpret_cast<uint16_t*>(b[s].data_ptr());
    for (int64_t j = 0; j < n; ++j)
      for (int64_t rr = 0; rr < rank; ++rr) bs[j * rank + rr] = bt[(rr / 2) * 2 * n + 2 * j + rr % 2];
  }
}
