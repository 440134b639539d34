// What the CPU's two paged attention kernels (attention_cpu.cpp: decode rows;
// prefill_attention_cpu.cpp: prefill chunks) share: the head sizes they take, and the checks on
// q, out and the paged caches that keep a wrong call from reading or writing out of bounds.
#pragma once

#include <ATen/ATen.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace loraplex_vec {

constexpr int MAX_D = 16 * V;  // head size bound: 16 vectors (256 with AVX-512, 128 with AVX2)
constexpr int MAX_G = 16;      // query heads per kv head

// q and out [T, Hq, D] alike with rows contiguous [Hq, D]; the caches contiguous
// [num_blocks, block_size, Hkv, D] alike; one dtype; D a multiple of V up to MAX_D; Hq = Hkv x
// 1..MAX_G. CPU tensors only.
inline void check_heads(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.sizes() == out.sizes(), "q and out must be [T, Hq, D] alike");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D] alike");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "q, out and the caches must share a dtype");
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d, "the caches' head size differs from q's");
  TORCH_CHECK(d % V == 0 && d <= MAX_D, "head size must be a multiple of ", V, " up to ", MAX_D);
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0 && hq / hkv <= MAX_G, "Hq must be Hkv times 1 to ", MAX_G);
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && q.stride(1) == d && out.stride(1) == d,
              "q and out rows must be contiguous [Hq, D]");
}

// The blocks holding positions 0 .. ctx - 1 (table[0 .. ceil(ctx / block_size)) ) exist.
inline void check_blocks(const int64_t* table, int64_t ctx, int64_t block_size, int64_t num_blocks) {
  for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id out of range");
}

// Positions p .. end - 1 of kv head h (D elements a row), asked of memory: a sequence's blocks
// lie anywhere in the cache, so the hardware prefetcher loses the stream at every block boundary.
template <int D, typename T>
inline void prefetch_rows(const T* k_cache, const T* v_cache, const int64_t* table, int64_t block_size, int64_t row,
                          int64_t h, int64_t p, int64_t end) {
  for (; p < end; ++p) {
    const int64_t at = (table[p / block_size] * block_size + p % block_size) * row + h * D;
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k_cache + at) + b);
      __builtin_prefetch(reinterpret_cast<const char*>(v_cache + at) + b);
    }
  }
}

// Positions p0 .. p0 + n - 1 of kv head h, read through the block table and widened to fp32 into
// kb / vb [C][DV * V] (C rows; those from n on zeroed: the caller masks them, and zeros keep
// whatever lies past the context, NaN included, out of the weighted sum), the next chunk's rows
// (up to position `end`) prefetched meanwhile. `row`: elements between positions in a block
// (Hkv * D).
template <int DV, int C, typename T>
inline void load_chunk(float (&kb)[C][DV * V], float (&vb)[C][DV * V], const T* k_cache, const T* v_cache,
                       const int64_t* table, int64_t block_size, int64_t row, int64_t h, int64_t p0, int n,
                       int64_t end) {
  constexpr int D = DV * V;
  prefetch_rows<D>(k_cache, v_cache, table, block_size, row, h, p0 + C, std::min<int64_t>(p0 + 2 * C, end));
  for (int c = 0; c < C; ++c) {
    if (c >= n) {
      const vf zero{};
      for (int j = 0; j < DV; ++j) __builtin_memcpy(kb[c] + j * V, &zero, sizeof(vf)), __builtin_memcpy(vb[c] + j * V, &zero, sizeof(vf));
      continue;
    }
    const int64_t p = p0 + c, block = table[p / block_size];
    const int64_t at = (block * block_size + p % block_size) * row + h * D;
    for (int j = 0; j < DV; ++j) {
      const vf kv = load_v(k_cache + at + j * V), vv = load_v(v_cache + at + j * V);
      __builtin_memcpy(kb[c] + j * V, &kv, sizeof(vf));
      __builtin_memcpy(vb[c] + j * V, &vv, sizeof(vf));
    }
  }
}

// f(std::integral_constant<int, DV>{}) for the head's DV = D / V vectors (1 .. MAX_D / V, as
// check_heads allows): the kernels take DV at compile time so that a head row stays in registers.
template <int... DVs, typename F>
inline void by_head_vectors_in(std::integer_sequence<int, DVs...>, int64_t dv, F&& f) {
  ((dv == DVs + 1 ? (f(std::integral_constant<int, DVs + 1>{}), true) : false) || ...);
}

template <typename F>
inline void by_head_vectors(int64_t dv, F&& f) {
  by_head_vectors_in(std::make_integer_sequence<int, MAX_D / V>{}, dv, std::forward<F>(f));
}

}  // namespace loraplex_vec
